"""The unified edit+compose agent (paper Section 6 "A unified edit+compose agent", Figure 7b / Figure 12).

Per instance (a gated-template scenario) the agent runs ``turns`` decisions. The POLICY DOCUMENT is
precompiled once in isolation and spliced (re-rotated) into the first turn's cache; it is never prefilled
again. Each turn the world state changes (the field toggles) and the change arrives as an appended erratum
line ahead of the decision prompt (``[STATE UPDATE] field: value``, the template's erratum wording); the turn
reuses the longest cached token prefix of the previous turn's cache and prefills only the delta (the new
erratum and the decision prompt: :func:`kvprobe.kv.edit.append_edit`). The baseline reprefills the whole
prompt every turn (full recompute). We report, per turn, the decision agreement of the unified cache with
full recompute (exact Clopper-Pearson interval over all decisions, and per instance), the logit cosine, and
the tokens each path ran through the model (the cumulative-prefill ratio; wall-clock TTFT is measured side
by side by ``benchmarks/agent.py``).

The placement baselines (Fig. 12a; ``baselines``) write the change into the field in place, with no erratum,
and reuse the previous turn's cache up to the first changed token (a prefix cache, reprefill-on-change;
checked against its own full recompute on the last turn, where the most is reused):
FRONT moves the policy ahead of the session context, so the policy stays cached and only the tokens from the
field on are prefilled again; END moves it after the conversation, just before the decision prompt, so every
change re-prefills the policy. Both are prompts of their own (the same token segments, reordered at the
section headers), each compared with its own full recompute; their decisions and prefilled tokens are
reported beside the unified path's.

Graded measures and must-fail controls (:mod:`kvprobe.probes.graded`): per turn, the two-action LD (right minus
wrong action, nats) of full recompute and of the unified cache and its distance from full recompute's; from turn 2
on, the *field effect retained* (the change in LD(new action - old) from the previous turn under the unified
cache over the same under full recompute), which reads even where every decision is the same. The ``frozen``
control (the first turn's cache reused every turn, never given the errata: the stale-cache bug; retained 0) is
read beside the unified path on every later turn, with the separation (LD error, retained) and its cluster CI.
``controls: [no_rotation_far]`` adds the unified path with the whole trajectory moved ``far_offset`` positions up,
the policy re-rotated there (``unified_far``) and not (``no_rotation_far``, the must-fail control).

Where our setting differs: small CPU models, the gated template's policy (~400 tokens) rather than the
paper's ~2k-token memories, and ``task.n_instances`` scenarios (one domain each, the clusters) x ``turns``
decisions per model on a shared CPU (the record states the n).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvprobe.backends import HookableModel
from kvprobe.claims import ACCURACY_MARGIN, RETAINED_MARGIN, SEPARATION_MARGIN, Claim
from kvprobe.kv.compose import Live, Spliced, assemble, precompile
from kvprobe.kv.edit import EditResult, append_edit
from kvprobe.kv.readout import prefill
from kvprobe.metrics import logit_cosine
from kvprobe.probes.decision import read_actions
from kvprobe.probes.graded import (FAR_OFFSET, arm_entry, arms_summary, controls_headline, controls_summary, far_check,
                                   graded_lines, pick, retained_across_turns)
from kvprobe.probes.summary import ci_cell
from kvprobe.schema import hash_neutral
from kvprobe.runner.experiment import Context, Experiment
from kvprobe.stats.inference import summarize_proportion
from kvprobe.tasks.edits import decision_offset, erratum_body, erratum_line, prompt_ids
from kvprobe.tasks.gated import action_token, instance_prompt, segment_prompt
from kvprobe.paper import headlines as paper_headlines


BASELINES = ("front", "end")
CONTROLS = ("no_rotation_far",)  # opt-in must-fail controls (the frozen cache is always read: it costs nothing)


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    turns: int = Field(3, ge=1, le=30, description="decisions per instance; the field toggles every turn")
    baselines: list[str] = Field(default_factory=lambda: list(BASELINES),
                                 description="placement baselines: front and/or end (in-place field, prefix cache)")

    controls: list[str] = hash_neutral([], description="opt-in must-fail controls: no_rotation_far (the trajectory "
                                       "moved far_offset positions up, the policy not re-rotated)")
    far_offset: int = hash_neutral(FAR_OFFSET, ge=2000, description="no_rotation_far: the trajectory moved this many "
                                   "positions up (the policy lands >= this far from where it was precompiled)")

    @field_validator("controls")
    @classmethod
    def _controls(cls, v: list[str]) -> list[str]:
        return pick(v, CONTROLS, "controls")

    @field_validator("baselines")
    @classmethod
    def _baselines(cls, v: list[str]) -> list[str]:
        if any(b not in BASELINES for b in v) or len(set(v)) != len(v):
            raise ValueError(f"baselines must be a subset of {list(BASELINES)}; got {v}")
        return v


def turn_prompts(ctx: Context, inst: Any, turns: int) -> list[tuple[list[int], str]]:
    """Token ids of each turn's prompt (errata 1..t ahead of the decision prompt) and the value in force."""
    tok, chat, tpl = ctx.lm.tokenizer, ctx.lm.has_chat_template, ctx.template
    values = [inst.new_value if t % 2 == 0 else inst.old_value for t in range(turns)]
    lines = [erratum_line(tpl, inst, v) for v in values]
    return [(prompt_ids(tok, inst, erratum_body(tpl, inst, inst.old_value, lines[: t + 1]), chat), values[t])
            for t in range(turns)]


def agent_turns(lm: HookableModel, prompts: list[list[int]], policy: tuple[int, int], start: int = 0,
                rotate: bool = True, compiled: Any = None) -> list[Any]:
    """The unified path: the first turn composes the precompiled policy; each later turn appends its delta to
    the previous turn's cache. Returns each turn's EditResult (state, query suffix, recomputed tokens).
    ``start`` moves the trajectory up; ``rotate`` False leaves the policy's keys at their isolated positions;
    ``compiled`` (a dict) keeps the policy's isolated prefill across calls."""
    p0, p1 = policy
    first = prompts[0]
    chunk = first[p0:p1]
    compiled = {} if compiled is None else compiled
    if tuple(chunk) not in compiled:
        compiled[tuple(chunk)] = precompile(lm, chunk)
    state = assemble(lm, [Live(tuple(first[:p0])), Spliced(tuple(chunk), compiled[tuple(chunk)], rotate=rotate),
                          Live(tuple(first[p1:-1]))], start)
    out = [EditResult(state, first[-1:], len(first) - 1 - len(chunk), len(first) - 1,
                      detail={"reused_tokens": 0, "appended_tokens": len(first) - 1 - len(chunk)})]
    cached, cached_ids = state, first[:-1]
    for ids in prompts[1:]:
        res = append_edit(lm, cached, cached_ids, ids, 1)
        out.append(res)
        cached, cached_ids = res.state, ids[:-1]
    return out


def placement_prompts(ctx: Context, inst: Any, values: list[str]) -> dict[str, list[list[int]]]:
    """Each baseline's prompt per turn: the field holds the turn's value in place; the policy's tokens moved
    ahead of the session context (front) or just before the decision prompt (end)."""
    tok, chat, tpl = ctx.lm.tokenizer, ctx.lm.has_chat_template, ctx.template
    decision = inst.after_field[decision_offset(tpl, inst):].split("\n", 1)[0]
    out: dict[str, list[list[int]]] = {b: [] for b in ctx.params.baselines}
    for v in values:
        ids, (c, p0, p1, d) = segment_prompt(tok, inst, v, chat, [tpl.context_header, tpl.policy_header,
                                                                   tpl.tools_header, decision])
        if not c < p0 < p1 < d:
            raise ValueError(f"instance {inst.index}: sections out of order: context, policy, tools, decision")
        if "front" in out:
            out["front"].append(ids[:c] + ids[p0:p1] + ids[c:p0] + ids[p1:])
        if "end" in out:
            out["end"].append(ids[:p0] + ids[p1:d] + ids[p0:p1] + ids[d:])
    return out


def prefix_cache_turns(lm: HookableModel, prompts: list[list[int]]) -> list[Any]:
    """Reprefill-on-change: the first turn prefills its prompt; each later turn reuses the previous turn's
    cache up to the first changed token and prefills the rest."""
    first = prompts[0]
    state = prefill(lm, first[:-1])
    out = [EditResult(state, first[-1:], len(first) - 1, len(first) - 1)]
    for prev, ids in zip(prompts, prompts[1:]):
        out.append(append_edit(lm, out[-1].state, prev[:-1], ids, 1))
    return out


def _read(lm: HookableModel, state: Any, suffix: list[int], right: int, wrong: int) -> tuple[bool, Any]:
    r = read_actions(lm, state, suffix, (right, wrong))
    return r.ld() > 0, r


def run_instance(ctx: Context, inst: Any) -> dict[str, Any]:
    lm, tpl, p = ctx.lm, ctx.template, ctx.params
    turns = turn_prompts(ctx, inst, p.turns)
    ids0, cuts = segment_prompt(lm.tokenizer, inst, inst.old_value, lm.has_chat_template,
                                [tpl.policy_header, tpl.tools_header])
    prompts = [ids for ids, _ in turns]
    if prompts[0][: cuts[1]] != ids0[: cuts[1]]:
        raise ValueError(f"instance {inst.index}: the turn prompt and the segmented prompt differ before the tools")
    compiled: dict[tuple[int, ...], Any] = {}
    results = agent_turns(lm, prompts, (cuts[0], cuts[1]), compiled=compiled)
    far = {}
    if "no_rotation_far" in p.controls:  # the trajectory moved far up: the policy re-rotated there, and not
        far = {name: agent_turns(lm, prompts, (cuts[0], cuts[1]), p.far_offset, rotate, compiled)
               for name, rotate in (("unified_far", True), ("no_rotation_far", False))}
    text, special = instance_prompt(lm.tokenizer, inst, inst.old_value, lm.has_chat_template)
    acts = {a: action_token(lm.tokenizer, ids0, text, a, special) for a in (inst.old_action, inst.new_action)}
    values = [value for _, value in turns]
    placed = {b: (ps, prefix_cache_turns(lm, ps)) for b, ps in placement_prompts(ctx, inst, values).items()}
    rows = []
    for t, ((ids, value), res) in enumerate(zip(turns, results)):
        right_action = inst.new_action if value == inst.new_value else inst.old_action
        right, wrong = acts[right_action], acts[inst.old_action if right_action == inst.new_action else inst.new_action]
        full_right, full = _read(lm, prefill(lm, ids[:-1]), ids[-1:], right, wrong)
        unified_right, unified = _read(lm, res.state, res.suffix_ids, right, wrong)
        row = {"turn": t + 1, "value": value, "agree": unified_right == full_right, "full_correct": full_right,
               "unified_correct": unified_right, "cosine": float(logit_cosine(unified.logits[0], full.logits[0])),
               "n_tokens": len(ids) - 1, "unified_prefilled": res.recomputed_tokens,
               "reprefill_prefilled": len(ids) - 1, "full_ld": full.ld(), "unified_ld": unified.ld()}
        # the frozen cache: the first turn's, never given the errata (the stale-cache bug)
        lds = {"unified": unified.ld(), "frozen": _read(lm, results[0].state, results[0].suffix_ids, right, wrong)[1].ld()}
        for name, fres in far.items():
            lds[name] = _read(lm, fres[t].state, fres[t].suffix_ids, right, wrong)[1].ld()
        row["graded"] = {n: arm_entry(ld, full.ld(), agree=(ld > 0) == full_right) for n, ld in lds.items()}
        if far:
            row["far_check"] = far_check(lds["unified_far"], lds["unified"])
        for b, (ps, bres) in placed.items():
            b_cached, _ = _read(lm, bres[t].state, bres[t].suffix_ids, right, wrong)
            row[b] = {"correct": b_cached, "agree_unified": b_cached == unified_right,
                      "n_tokens": len(ps[t]) - 1, "prefilled": bres[t].recomputed_tokens}
            if t == len(turns) - 1 and t > 0:  # the most-reused cache checked against its full recompute (CPU)
                row[b]["agree"] = b_cached == _read(lm, prefill(lm, ps[t][:-1]), ps[t][-1:], right, wrong)[0]
        rows.append(row)
    retained_across_turns(rows, inst.new_value, "full_ld", "unified", {"no_rotation_far": "unified_far"})
    policy_tokens = cuts[1] - cuts[0]
    unified_total = sum(r["unified_prefilled"] for r in rows)
    return {**inst.row(), "policy_tokens": policy_tokens, "turns": rows, "all_agree": all(r["agree"] for r in rows),
            "prefill_ratio": sum(r["reprefill_prefilled"] for r in rows) / unified_total,
            "baseline_prefill_ratio": {b: sum(r[b]["prefilled"] for r in rows) / unified_total for b in placed},
            "baseline_last_turn_agree": {b: rows[-1][b]["agree"] for b in placed if "agree" in rows[-1][b]}}


def summarize_rows(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, Any]:
    decisions = [t for r in rows for t in r["turns"]]
    return {"n_instances": len(rows), "n_decisions": len(decisions),
            "agreement": summarize_proportion([t["agree"] for t in decisions]),
            "agreement_by_instance": summarize_proportion([all(t["agree"] for t in r["turns"]) for r in rows],
                                                          [r["scenario"] for r in rows]),
            "full_accuracy": summarize_proportion([t["full_correct"] for t in decisions]),
            "unified_accuracy": summarize_proportion([t["unified_correct"] for t in decisions]),
            "cosine_mean": sum(t["cosine"] for t in decisions) / len(decisions),
            "cosine_min": min(t["cosine"] for t in decisions),
            "prefill_ratio_mean": sum(r["prefill_ratio"] for r in rows) / len(rows),
            "policy_tokens_mean": sum(r["policy_tokens"] for r in rows) / len(rows),
            "n_domains": len({r.get("family", r["scenario"]) for r in rows}),
            "baselines": {b: {"accuracy": summarize_proportion([t[b]["correct"] for t in decisions]),
                              "agreement_last_turn": summarize_proportion(
                                  [r["baseline_last_turn_agree"][b] for r in rows if b in r["baseline_last_turn_agree"]],
                                  [r["scenario"] for r in rows if b in r["baseline_last_turn_agree"]]),
                              "agreement_with_unified": summarize_proportion([t[b]["agree_unified"] for t in decisions]),
                              "prefill_ratio_mean": sum(r["baseline_prefill_ratio"][b] for r in rows) / len(rows),
                              "prefilled_per_turn": [sum(r["turns"][k][b]["prefilled"] for r in rows) / len(rows)
                                                     for k in range(len(rows[0]["turns"]))]}
                          for b in (rows[0]["turns"][0].keys() & set(BASELINES))},
            "unified_prefilled_per_turn": [sum(r["turns"][k]["unified_prefilled"] for r in rows) / len(rows)
                                           for k in range(len(rows[0]["turns"]))],
            **_graded_summary(ctx, rows)}


def _graded_summary(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Graded measures over every turn, and the controls over turns 2.. (clusters: the instance's scenario)."""
    turns = [(r["scenario"], t) for r in rows for t in r["turns"]]
    out: dict[str, Any] = {}
    if any("graded" in t for _, t in turns):
        out["graded"] = arms_summary([(s, t["graded"]) for s, t in turns if "graded" in t], ctx.cfg.seed)
    if any("controls" in t for _, t in turns):
        out["controls"] = controls_summary([(s, t["controls"]) for s, t in turns if "controls" in t], ctx.cfg.seed)
        far = [t["far_check"] for _, t in turns if "far_check" in t]
        if far:
            out["far_check_max"] = max(far)
    return out


def table(s: dict[str, Any]) -> str:
    out = (f"instances {s['n_instances']}, decisions {s['n_decisions']}; unified vs full-recompute agreement "
           f"{ci_cell(s['agreement'])} (exact; per instance, all turns: {ci_cell(s['agreement_by_instance'])}); "
           f"cosine mean {s['cosine_mean']:.4f} min {s['cosine_min']:.4f}; accuracy full "
           f"{ci_cell(s['full_accuracy'])} unified {ci_cell(s['unified_accuracy'])}; prefilled tokens, reprefill "
           f"over unified: {s['prefill_ratio_mean']:.2f}x (policy {s['policy_tokens_mean']:.0f} tokens)")
    acc = s["full_accuracy"]
    if acc.get("ci_low") is None or acc["ci_low"] <= 0.5:
        out += (f"; full-recompute accuracy {acc['mean']:.2f} is not above chance, so accuracies are uninformative "
                "here, and so is agreement with full recompute (a cache that keeps the model's bias agrees too)")
    for b, x in sorted(s.get("baselines", {}).items()):
        out += (f"\n  {b} placement (in-place field, prefix cache): accuracy {ci_cell(x['accuracy'])}, last turn's "
                f"agreement with its full recompute {ci_cell(x['agreement_last_turn'])}, with the unified decision "
                f"{ci_cell(x['agreement_with_unified'])}; prefilled tokens over unified {x['prefill_ratio_mean']:.2f}x")
    if "graded" in s:
        out += ("\n  graded per turn vs full recompute (field effect retained from turn 2: the LD change since the "
                "previous turn over full recompute's)" + (f"; the re-rotated policy moved far up vs in place: max |dLD| "
                                                         f"{s['far_check_max']:.1e} (~0 if exact)"
                                                         if "far_check_max" in s else "") + ":\n")
        out += "\n".join(graded_lines(s["graded"], s.get("controls"), "  "))
    return out


EXPERIMENT = Experiment(
    section="sec6", section_order=2,
    name="agent", doc=__doc__, needs_template=True, params=Params, run_instance=run_instance,
    summarize=summarize_rows, table=table,
    headline=lambda s: table(s).split("\n")[0].split("; ", 1)[1]
    + (f"; {controls_headline(s['controls'])}" if s.get("controls") else ""),
    paper=paper_headlines("agent"),
    claims=(
        Claim("agent_agreement", "the unified agent decides as full recompute every turn", "at_least", "all_agree", bound=1 - ACCURACY_MARGIN,
              gated=False, role="effect", competence=("turns.*.full_correct",)),
        Claim("agent_front_prefix_cache", "the front-placement baseline's prefix cache (reprefill-on-change) decides "
              "as its own full recompute on the last turn",
              "at_least", "baseline_last_turn_agree.front", bound=1 - ACCURACY_MARGIN, gated=False,
              role="control", competence=("turns.*.full_correct",)),
        # Must-fail controls beside the unified path, graded (no competent model needed; per instance, averaged over
        # turns 2..), by kvprobe's own margins: the frozen cache (never given the errata) retains 0 by construction.
        Claim("agent_frozen_retained_separation", "the unified cache retains more of full recompute's turn-to-turn "
              f"response to the errata than a frozen cache, by more than kvprobe's margin ({RETAINED_MARGIN})",
              "greater", "turns.*.controls.frozen.retained_separation", RETAINED_MARGIN, gated=False, role="control"),
        Claim("agent_far_rotation_separation", "the policy spliced without re-rotation >= 2,000 positions from its "
              "precompile is further from full recompute's LD than the re-rotated policy there, by more than "
              f"kvprobe's margin ({SEPARATION_MARGIN} nats)", "greater",
              "turns.*.controls.no_rotation_far.separation", SEPARATION_MARGIN, gated=False, role="control"),
    ))
