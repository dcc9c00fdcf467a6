"""Long horizon: do leave-stale + erratum errors compound over a trajectory? (paper Appendix G, Figure 23)

For each instance the gated field toggles between its two values every turn for ``turns`` turns. We keep ONE
evolving cache: the static prefix (the prompt up to the end of the conversation) is prefilled once and never
recomputed; at each turn the field's own tokens are refreshed in place to the current value and one
erratum line announcing it is appended (scheme field_erratum; scheme erratum leaves the field at its first
value), and the decision is read by running the decision prompt over the cache. The same turn is read from a
full reprefill of the byte-identical token sequence (the current field value, every erratum so far, the
decision prompt), so the only difference between the two is whether the downstream KV was recomputed after
each change. Per turn we record decision agreement (argmax of the two action tokens) and the cosine of the
full next-token logits; over turns, the slope of each and the first-third vs last-third profile. The paper
(Qwen3-8B, Llama-3.1-8B, Mistral-7B) finds cosine 0.987-0.999, flat, and agreement slopes within +-0.01/turn.

Graded measures and a must-fail control (:mod:`kvprobe.probes.graded`): per turn, the evolving cache's and the
reference's LD (right minus wrong action) with the cache's distance from the reference; from turn 2 on, its
*field effect retained* (the turn-to-turn change in LD(new value's action - old) under the cache over the same
under the reprefill). Beside it the ``frozen`` cache, the static prefix never given a refresh or an erratum (the
stale-cache bug: retained 0), with the separation (LD error; retained) and its cluster CI: a flat agreement over
turns says nothing unless the frozen cache visibly fails the same turns.

Where our setting differs: small embedded models; the token sequence is the cached prefix's tokens, each
erratum's tokens and the decision prompt's tokens (decoded, it is exactly the text of the full prompt); the
row records whether that sequence is also the canonical tokenization of the text. Scheme erratum is a
numerical control: its two arms compute the same function of the same tokens, so they agree to float error.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from kvprobe.errors import KVProbeError
from kvprobe.kv.edit import recompute_slots
from kvprobe.kv.readout import prefill
from kvprobe.metrics import logit_cosine
from kvprobe.probes.decision import read_actions
from kvprobe.probes.edit_summary import base_row, edit_case, edit_gate_summary
from kvprobe.probes.controls import paired_contrast
from kvprobe.probes.graded import (arm_entry, arms_summary, controls_headline, controls_summary, graded_lines,
                                   retained_across_turns)
from kvprobe.probes.summary import ci_cell, summarize_column
from kvprobe.claims import ACCURACY_MARGIN, RETAINED_MARGIN, Claim, near
from kvprobe.runner.experiment import Context, Experiment
from kvprobe.tasks.edits import decision_char, erratum_body, erratum_line, prompt_ids, prompt_text, split_prompt_at
from kvprobe.paper import headlines as paper_headlines


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    turns: int = Field(28, ge=1)
    scheme: Literal["field_erratum", "erratum"] = "field_erratum"
    erratum_wording: str | None = Field(None, description="over {field}, {new_value}; null: the template's erratum")
    n_boot: int = Field(2000, ge=100, description="bootstrap resamples (over instances) for the slopes")


def run_instance(ctx: Context, inst: Any) -> dict[str, Any]:
    lm, p, tok, chat = ctx.lm, ctx.params, ctx.lm.tokenizer, ctx.lm.has_chat_template
    c = edit_case(ctx, inst, 1)
    pair = c.pair
    text, special = prompt_text(tok, inst, inst.body(inst.old_value), chat)
    head, query_text = split_prompt_at(tok, text, special, decision_char(ctx.template, text))
    # Separators lead each later piece ("\n\n" + line, "\n\n" + decision prompt): a piece ending in whitespace
    # would tokenize differently alone than before the next piece in the full text.
    query = list(tok("\n\n" + query_text, add_special_tokens=False)["input_ids"])
    heads = {inst.old_value: list(pair.ids_old[: len(head)]), inst.new_value: list(pair.ids_new[: len(head)])}
    if heads[inst.old_value] != head:
        raise KVProbeError("the cached prefix does not tokenize as the prompt's own prefix")
    action_id = {inst.old_value: pair.old_action_id, inst.new_value: pair.new_action_id}
    other = {inst.old_value: inst.new_value, inst.new_value: inst.old_value}

    state = c.pp.old.slice(0, len(head))  # the static prefix, prefilled once
    # the frozen cache: the static prefix, never refreshed nor given an erratum; its LD for each value's turns
    frozen_read = read_actions(lm, state, query, (pair.old_action_id, pair.new_action_id))
    frozen = (frozen_read.ld(), -frozen_read.ld())  # right - wrong when the old value / the new value is in force
    appended: list[int] = []
    lines: list[str] = []
    turns = []
    for t in range(1, p.turns + 1):
        value = inst.new_value if t % 2 else inst.old_value
        field_value = value if p.scheme == "field_erratum" else inst.old_value
        lines.append(erratum_line(ctx.template, inst, value, p.erratum_wording))
        err = list(tok(("\n\n" if t > 1 else "") + lines[-1], add_special_tokens=False)["input_ids"])
        recomputed = 0
        if p.scheme == "field_erratum":
            state = recompute_slots(lm, state, heads[value] + appended, pair.field_slots)
            recomputed = len(pair.field_slots)
        state = prefill(lm, err, prior=state)
        appended += err
        seq = heads[field_value] + appended
        full = prefill(lm, seq)
        reads = read_actions(lm, [state, full], query, (action_id[value], action_id[other[value]]))  # one batch
        ld = reads.lds
        canonical = prompt_ids(tok, inst, erratum_body(ctx.template, inst, field_value, lines), chat) == seq + query
        frozen_ld = frozen[0] if value == inst.old_value else frozen[1]
        turns.append({"turn": t, "value": value, "cache_ld": ld[0], "reference_ld": ld[1],
                      "cache_correct": ld[0] > 0, "reference_correct": ld[1] > 0, "agree": (ld[0] > 0) == (ld[1] > 0),
                      "cosine": float(logit_cosine(reads.logits[0], reads.logits[1])),
                      "recomputed_tokens": recomputed + len(err), "total_tokens": len(seq),
                      "canonical_tokenization": canonical,
                      "graded": {"cache": arm_entry(ld[0], ld[1], agree=(ld[0] > 0) == (ld[1] > 0)),
                                 "frozen": arm_entry(frozen_ld, ld[1], agree=(frozen_ld > 0) == (ld[1] > 0))}})
    retained_across_turns(turns, inst.new_value, "reference_ld", "cache")
    return {**base_row(ctx, inst, c), "scheme": p.scheme, "prefix_tokens": len(head),
            "query_tokens": len(query), "turns": turns}


def _slope(y_by_instance: np.ndarray) -> float:
    turns = np.arange(1, y_by_instance.shape[1] + 1)
    return float(np.polyfit(turns, y_by_instance.mean(axis=0), 1)[0]) if turns.size > 1 else float("nan")


def _slope_ci(y: np.ndarray, n_boot: int, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    boots = [_slope(y[rng.integers(0, y.shape[0], y.shape[0])]) for _ in range(n_boot)] if y.shape[0] > 1 else []
    lo, hi = (np.quantile(boots, [0.025, 0.975]) if boots else (float("nan"), float("nan")))
    return {"slope": _slope(y), "ci_low": float(lo), "ci_high": float(hi), "n_instances": int(y.shape[0])}


def summarize_rows(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = edit_gate_summary(ctx, rows)
    used = [r for r in rows if r["included"]] or rows
    seed = ctx.cfg.seed

    def grid(key: str) -> np.ndarray:
        return np.asarray([[float(t[key]) for t in r["turns"]] for r in used])

    agree, cosine = grid("agree"), grid("cosine")
    n_turns = agree.shape[1]
    third = max(1, n_turns // 3)
    out["scheme"] = ctx.params.scheme
    out["turns"] = n_turns
    out["per_turn"] = [{"turn": i + 1, "agreement": float(agree[:, i].mean()), "cosine": float(cosine[:, i].mean()),
                        "cache_accuracy": float(grid("cache_correct")[:, i].mean()),
                        "reference_accuracy": float(grid("reference_correct")[:, i].mean())} for i in range(n_turns)]
    # per instance, the mean over turns; CIs resample scenarios (instances of one scenario share its wording)
    out["agreement"] = summarize_column(used, agree.mean(axis=1).tolist(), seed=seed)
    out["cosine"] = summarize_column(used, cosine.mean(axis=1).tolist(), seed=seed)
    out["agreement_slope_per_turn"] = _slope_ci(agree, ctx.params.n_boot, seed)
    out["cosine_slope_per_turn"] = _slope_ci(cosine, ctx.params.n_boot, seed)
    out["cosine_first_third"] = float(cosine[:, :third].mean())
    out["cosine_last_third"] = float(cosine[:, -third:].mean())
    # The decision is what is judged (full-vocabulary cosine stays high on a cache that never follows the
    # erratum): per instance, agreement over all turns, over the first and the last third, and its change.
    cache_acc, ref_acc = grid("cache_correct").mean(axis=1), grid("reference_correct").mean(axis=1)
    first, last = agree[:, :third].mean(axis=1), agree[:, -third:].mean(axis=1)
    out["row_measures"] = {"decision_by_turn": {
        "what": "per instance: decision agreement with the reprefill over all turns, its first and last third and "
                "last minus first, and the cache's and the reference's accuracy; the claims rows test these",
        "rows": {str(r["index"]): {"agreement": float(agree[i].mean()), "first_third": float(first[i]),
                                   "last_third": float(last[i]), "last_minus_first": float(last[i] - first[i]),
                                   "cache_accuracy": float(cache_acc[i]), "reference_accuracy": float(ref_acc[i])}
                 for i, r in enumerate(used)}}}
    out["agreement_per_turn"] = [summarize_column(used, [bool(t) for t in agree[:, i] > 0.5]) for i in range(n_turns)]
    out["agreement_last_minus_first"] = paired_contrast(used, last.tolist(), first.tolist(), seed)
    out["cache_minus_reference_accuracy"] = paired_contrast(used, cache_acc.tolist(), ref_acc.tolist(), seed)
    out["reference_accuracy"] = float(grid("reference_correct").mean())
    out["cache_accuracy"] = float(grid("cache_correct").mean())
    out["canonical_tokenization"] = float(grid("canonical_tokenization").mean())
    last = [r["turns"][-1] for r in used]
    out["recompute_fraction_last_turn"] = float(np.mean([t["recomputed_tokens"] / t["total_tokens"] for t in last]))
    turns = [(r["scenario"], t) for r in used for t in r["turns"]]
    if any("graded" in t for _, t in turns):  # graded: turn-level entries, clustered by scenario
        out["graded"] = arms_summary([(sc, t["graded"]) for sc, t in turns if "graded" in t], seed)
        out["controls"] = controls_summary([(sc, t["controls"]) for sc, t in turns if "controls" in t], seed)
    return out


def table(s: dict[str, Any]) -> str:
    a, c = s["agreement_slope_per_turn"], s["cosine_slope_per_turn"]
    return "\n".join([
        f"instances {s['n_instances']}, included {s['n_included']} (inclusion rule: flip >= {s['gate']['min_flip']}); "
        f"summary over {s['summary_over']}; scheme {s['scheme']}, {s['turns']} turns",
        f"decision agreement {ci_cell(s['agreement'], 3)}"
        f", slope {a['slope']:+.4f}/turn [{a['ci_low']:+.4f}, {a['ci_high']:+.4f}]",
        f"logit cosine {s['cosine']['mean']:.4f}, first third {s['cosine_first_third']:.4f} -> last third "
        f"{s['cosine_last_third']:.4f}, slope {c['slope']:+.5f}/turn",
        f"accuracy: reference {s['reference_accuracy']:.3f}, evolving cache {s['cache_accuracy']:.3f}; "
        f"canonical tokenization {s['canonical_tokenization']:.2f}",
        *(["graded per turn vs the reprefill (retained from turn 2: the LD change since the previous turn over the "
           "reprefill's); the frozen cache never gets a refresh or an erratum:"]
          + graded_lines(s["graded"], s.get("controls")) if "graded" in s else [])])


def headline(s: dict[str, Any]) -> str:
    a = s["agreement_slope_per_turn"]

    def num(x: float | None) -> str:  # a CI over one instance is undefined (stored as null)
        return "n/a" if x is None or x != x else f"{x:+.4f}"

    lead = ""
    if "agreement_last_minus_first" in s:  # records written before the decision block have none
        d, acc = s["agreement_last_minus_first"]["difference"], s["cache_minus_reference_accuracy"]
        lead = (f"decision agreement per turn {ci_cell(s['agreement'])} (n {s['agreement']['n']}, "
                f"{s['agreement']['n_clusters']} scenarios), last - first third {ci_cell(d, 2, signed=True)}; "
                f"cache accuracy {acc['effect']['mean']:.2f} vs reference {acc['control']['mean']:.2f} "
                f"({ci_cell(acc['difference'], 2, signed=True)}); ")
    return lead + (f"{s['turns']} turns ({s['scheme']}): agreement {ci_cell(s['agreement'])}, "
                   f"cosine {ci_cell(s['cosine'], 3)} "
                   f"(first third {s['cosine_first_third']:.3f} -> last {s['cosine_last_third']:.3f}); agreement "
                   f"slope {num(a['slope'])}/turn [{num(a['ci_low'])}, {num(a['ci_high'])}]; reprefill accuracy "
                   f"{s['reference_accuracy']:.2f}") + (f"; {controls_headline(s['controls'])}" if s.get("controls")
                                                       else "")


EXPERIMENT = Experiment(name="long_horizon", doc=__doc__, needs_template=True, params=Params, run_instance=run_instance,
                        section="appG",
                        summarize=summarize_rows, table=table, headline=headline,
                        paper=paper_headlines("long_horizon"),
                        # Per instance, averaged over its turns (the ``*`` step), so turns of one conversation are not counted as
                        # independent. The paper's App. G design only appends turns and errata to a persistent cache
                        # and compares it with a full prefill of the same text: no KV is ever stale, so its numbers
                        # are a numerical and tokenization floor. That is kvprobe's ``erratum`` scheme; for
                        # ``field_erratum`` (stale notes) the paper has no counterpart. On the erratum scheme the
                        # claims are numerical controls (the two arms compute the same function of the same tokens),
                        # never effects: they cannot fail on fp32 CPU arithmetic.
                        claims=(near("cosine_high", "the appended cache's next-token logits stay close to the "
                                     "reference over turns (a numerical floor)",
                                     "turns.*.cosine", 0.993, margin=0.01, in_paper_range=True,
                                     role="control", params=(("scheme", "erratum"),)),
                                near("agreement_in_range", "the appended cache decides as the reference over turns", "turns.*.agree", 0.89,
                                     margin=ACCURACY_MARGIN, in_paper_range=True, role="control",
                                     params=(("scheme", "erratum"),)),
                                near("no_compounding_drift", "agreement does not drift over turns (slope per turn "
                                     "~ 0)", "turns.@slope.agree", 0.0, margin=0.0, in_paper_range=True,
                                     role="control", params=(("scheme", "erratum"),)),
                                Claim("agreement_field_erratum", "with the field refreshed in place + an erratum "
                                      "(stale notes), the cache decides as the reference over turns (described)",
                                      "describe", "turns.*.agree", role="effect", params=(("scheme", "field_erratum"),)),
                                # The must-fail control beside the appended cache (per instance, averaged over turns
                                # 2..): a frozen cache retains none of the reprefill's turn-to-turn response.
                                Claim("frozen_retained_separation", "the appended cache retains more of the "
                                      "reprefill's turn-to-turn response to the errata than a frozen cache (never "
                                      f"given them), by more than kvprobe's margin ({RETAINED_MARGIN})", "greater",
                                      "turns.*.controls.frozen.retained_separation", RETAINED_MARGIN, gated=False,
                                      role="control", params=(("scheme", "erratum"),))))
