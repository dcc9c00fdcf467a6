"""Transplant: a precompiled skill chunk, re-rotated and spliced, versus full recompute (paper Section 5,
Figure 6b; Appendix F scorecard; the no-rotation control of Figure 9b; the seam-repair knob).

The skill is the context's POLICY DOCUMENT (the binding rule and the filler rules). It is prefilled once in
isolation at positions 0..L-1, its keys are re-rotated to where it lands after the session context, and the
rest of the prompt (tools, conversation, decision prompt) is prefilled over the composed cache. We compare
the next-token logits with a full prefill of the byte-identical tokens: logit cosine and decision agreement
(the two action tokens). Controls and knobs: no rotation (keys left at their isolated positions: must
collapse), seam repair (the first k chunk tokens recomputed with the real preceding context), and the skill
split into N independently precompiled blocks. The RoPE gate runs first and its result is recorded.

Other insertion points (``other_chunks``): the facts chunk (the SESSION CONTEXT with the field, spliced right
after the system prompt), the tool specifications (system area, right after the skill) and the conversation
turn (mid-trajectory, just before the decision prompt), each precompiled alone and spliced with and without
rotation (variants ``facts_seam0``, ``tools_seam0``, ``conversation_no_rotation``, ...).

Graded measures and must-fail controls (:mod:`kvprobe.probes.graded`): every variant's two-action LD (``<v>_ld``,
new action minus old, nats) beside full recompute's (``full_ld``). ``field_effect`` rebuilds the skill's seam 0/1
and no-rotation variants on the old-value prompt, so each carries the *field effect retained* (LD change between
the field's values under the variant's caches over the same under full recompute), read even where every
decision is the same. ``controls`` adds must-fail arms beside their treatments (separation = the control's LD
error minus the treatment's, with its cluster CI): ``no_rotation_far`` (the context moved ``far_offset``
positions up, the skill spliced there without re-rotation; treatment ``seam0_far``, re-rotated there),
``shuffled`` (the skill in ``shuffle_blocks`` blocks in reverse order; treatment the same blocks in order),
``wrong_chunk`` (another scenario's skill spliced in place; treatment ``seam0``) and ``stale`` (with
``field_effect``: the old value's full-recompute cache read as the new: retained 0).

Where our setting differs: small CPU models; the chunks are parts of the gated prompt, so every one of them
but the facts chunk sits after the mutable field and its isolated precompile misses field-conditioned notes
(the paper's skills do not depend on an upstream field); the conversation chunk stands in for the paper's
tool-result insertion.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvprobe.kv.compose import Compiled, Live, Spliced, assemble, precompile, splice_spans
from kvprobe.kv.gate import run_gate
from kvprobe.kv.readout import prefill
from kvprobe.metrics import decision_agreement, logit_cosine
from kvprobe.claims import KVPROBE_RATE_BOUND, RETAINED_MARGIN, SEPARATION_MARGIN, Claim, near
from kvprobe.runner.experiment import Context, Experiment
from kvprobe.probes.controls import paired_contrast
from kvprobe.probes.decision import read_actions, read_named
from kvprobe.probes.graded import (FAR_OFFSET, arm_entry, arms_summary, control_entry, controls_headline,
                                   controls_summary, far_check, field_effect_retained, graded_lines, pick)
from kvprobe.probes.summary import ci_cell, summarize_column
from kvprobe.schema import hash_neutral
from kvprobe.tasks.gated import segment_prompt
from kvprobe.paper import headlines as paper_headlines


CONTROLS = {"no_rotation_far": "seam0_far", "shuffled": "blocks{s}", "wrong_chunk": "seam0",
            "stale": "seam0"}  # must-fail control -> its treatment
RETAINED_ARMS = ("seam0", "seam1", "no_rotation")  # the variants field_effect rebuilds on the old value


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    seam_repair: list[int] = Field(default_factory=lambda: [0, 1, 4, 16])
    n_blocks: list[int] = Field(default_factory=lambda: [1, 2, 4])
    gate_chunk_len: int = 32
    other_chunks: list[Literal["facts", "tools", "conversation"]] = Field(
        default_factory=lambda: ["facts", "tools", "conversation"],
        description="further chunks transplanted alone (seam 0 and no rotation): facts (the session context, "
                    "right after the system prompt), tools (system area), conversation (mid-trajectory)")
    field_effect: bool = hash_neutral(False, description="the skill's seam0/seam1/no_rotation (and the controls) "
                                                         "also built on the old value: each one's field effect retained")
    controls: list[str] = hash_neutral([], description="must-fail controls beside their treatment: "
                                       + ", ".join(CONTROLS) + " ('stale' needs field_effect)")
    far_offset: int = hash_neutral(FAR_OFFSET, ge=2000, description="no_rotation_far: the context moved this many "
                                   "positions up (the skill lands >= this far from where it was precompiled)")
    shuffle_blocks: int = hash_neutral(4, ge=2, description="shuffled: the skill cut into this many blocks")

    @field_validator("controls")
    @classmethod
    def _controls(cls, v: list[str]) -> list[str]:
        return pick(v, list(CONTROLS), "controls")

    @model_validator(mode="after")
    def _stale_needs_field_effect(self) -> "Params":
        if "stale" in self.controls and not self.field_effect:
            raise ValueError("the stale control reads the old value's cache: set field_effect=true")
        return self


def setup(ctx: Context) -> None:
    ctx.scratch["gate"] = run_gate(ctx.lm, chunk_len=ctx.params.gate_chunk_len, offsets=(17, 500, 3000))


def _chunk_markers(tpl: Any) -> dict[str, list[str]]:
    """The text that opens each transplantable chunk and the text that opens what follows it."""
    decision = tpl.decision_prompt.split("\n", 1)[0]
    return {"facts": [tpl.context_header, tpl.policy_header], "policy": [tpl.policy_header, tpl.tools_header],
            "tools": [tpl.tools_header, tpl.conversation_header], "conversation": [tpl.conversation_header, decision]}


def _other_chunk_variants(ctx: Context, ids: list[int], bounds: dict[str, tuple[int, int]]) -> dict[str, Any]:
    out = {}
    for name in ctx.params.other_chunks:
        c0, c1 = bounds[name]
        head, chunk, tail = ids[:c0], ids[c0:c1], ids[c1:-1]
        whole = precompile(ctx.lm, chunk)
        out[f"{name}_seam0"] = [Live(tuple(head)), Spliced(tuple(chunk), whole), Live(tuple(tail))]
        out[f"{name}_no_rotation"] = [Live(tuple(head)), Spliced(tuple(chunk), whole, rotate=False), Live(tuple(tail))]
    return out


def _variants(ctx: Context, head: list[int], chunk: list[int], tail: list[int]) -> dict[str, Any]:
    lm = ctx.lm
    whole = precompile(lm, chunk)
    out = {f"seam{k}": [Live(tuple(head)), Spliced(tuple(chunk), whole, seam=k), Live(tuple(tail))]
           for k in ctx.params.seam_repair}
    out["no_rotation"] = [Live(tuple(head)), Spliced(tuple(chunk), whole, rotate=False), Live(tuple(tail))]
    for n in ctx.params.n_blocks:
        if n == 1:
            continue
        bounds = [round(i * len(chunk) / n) for i in range(n + 1)]
        parts = [chunk[a:b] for a, b in zip(bounds, bounds[1:])]
        out[f"blocks{n}"] = [Live(tuple(head)), *(Spliced(tuple(p), precompile(lm, p)) for p in parts),
                             Live(tuple(tail))]
    return out


def _control_states(ctx: Context, inst: Any, ids: list[int], c0: int, c1: int, compiled: Compiled) -> dict[str, Any]:
    """The controls' arms on a prompt with the skill at [c0, c1) (and treatments beyond the variants)."""
    lm, p = ctx.lm, ctx.params
    end = len(ids) - 1
    out: dict[str, Any] = {}
    if "no_rotation_far" in p.controls:
        out["seam0_far"] = splice_spans(lm, ids, [c0, c1], end, start=p.far_offset, compiled=compiled)
        out["no_rotation_far"] = splice_spans(lm, ids, [c0, c1], end, rotate=False, start=p.far_offset,
                                              compiled=compiled)
    if "shuffled" in p.controls:
        n = p.shuffle_blocks
        cuts = [c0 + round(i * (c1 - c0) / n) for i in range(n + 1)]
        out[f"blocks{n}"] = splice_spans(lm, ids, cuts, end, compiled=compiled)
        out["shuffled"] = splice_spans(lm, ids, cuts, end, order=list(range(n - 1, -1, -1)), compiled=compiled)
    if "wrong_chunk" in p.controls:  # the skill of the next scenario's instance, spliced where this one was
        others = [x for x in (getattr(ctx, "instances", None) or []) if x.scenario != inst.scenario]
        if others:
            other = others[inst.index % len(others)]
            o_ids, (o0, o1) = segment_prompt(lm.tokenizer, other, other.new_value, lm.has_chat_template,
                                             _chunk_markers(ctx.template)["policy"])
            wrong = ids[:c0] + o_ids[o0:o1] + ids[c1:]
            out["wrong_chunk"] = splice_spans(lm, wrong, [c0, c0 + o1 - o0], len(wrong) - 1, compiled=compiled)
    return out


def run_instance(ctx: Context, inst: Any) -> dict[str, Any]:
    lm, tpl, p = ctx.lm, ctx.template, ctx.params
    markers = _chunk_markers(tpl)
    needed = ["policy", *p.other_chunks]
    ids, cuts = segment_prompt(lm.tokenizer, inst, inst.new_value, lm.has_chat_template,
                               [m for name in needed for m in markers[name]])
    bounds = {name: (cuts[2 * i], cuts[2 * i + 1]) for i, name in enumerate(needed)}
    query = ids[-1:]
    c0, c1 = bounds["policy"]
    head, chunk, tail = ids[:c0], ids[c0:c1], ids[c1:-1]
    new_id = lm.tokenizer(" " + inst.new_action, add_special_tokens=False)["input_ids"][0]
    old_id = lm.tokenizer(" " + inst.old_action, add_special_tokens=False)["input_ids"][0]
    tokens = (new_id, old_id)
    full_read = read_actions(lm, prefill(lm, ids[:-1]), query, tokens)
    full = full_read.logits
    names, states = [], []
    variants = {**_variants(ctx, head, chunk, tail), **_other_chunk_variants(ctx, ids, bounds)}
    for name, pieces in variants.items():
        names.append(name)
        states.append(assemble(lm, pieces))
    reads = read_actions(lm, states, query, tokens, batch_size=ctx.cfg.batch_size)
    logits = reads.logits
    row = {**inst.row(), "n_tokens": len(ids), "chunk_tokens": len(chunk), "chunk_start": c0,
           "chunks": {name: list(b) for name, b in bounds.items()},
           "full_correct": bool(full[0, new_id] > full[0, old_id]), "full_ld": full_read.ld()}
    arms: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(names):
        row[f"{name}_cosine"] = float(logit_cosine(logits[i], full[0]))
        row[f"{name}_agree"] = float(decision_agreement(logits[i], full[0], [new_id, old_id]))
        row[f"{name}_ld"] = reads.ld(i)
        arms[name] = arm_entry(reads.ld(i), full_read.ld(), agree=bool(row[f"{name}_agree"]))
    compiled: Compiled = {}
    extra = _control_states(ctx, inst, ids, c0, c1, compiled)
    for name, rd in read_named(lm, extra, query, tokens, ctx.cfg.batch_size).items():
        arms[name] = arm_entry(rd.ld(), full_read.ld(), agree=(rd.ld() > 0) == (full_read.ld() > 0),
                               cosine=float(logit_cosine(rd.logits[0], full[0])))
    controls = {c: t.format(s=p.shuffle_blocks) for c, t in CONTROLS.items() if c in p.controls}
    if p.field_effect:
        row["old_value_arms"] = _old_value_arms(ctx, inst, markers, tokens, arms, full_read.ld(), "stale" in controls)
    if "seam0_far" in arms:
        row["far_check"] = far_check(arms["seam0_far"]["ld"], arms["seam0"]["ld"])
        row["far_distance"] = p.far_offset + c0
    row["graded"] = {"arms": arms}
    new_arms = row.get("old_value_arms", {}).get("new_arms", {})
    row["controls"] = {c: control_entry(t, new_arms if c == "stale" else arms, c) for c, t in controls.items()
                       if c in arms or c in new_arms}
    if not row["controls"]:
        del row["controls"]
    return row


def _old_value_arms(ctx: Context, inst: Any, markers: dict[str, list[str]], tokens: tuple[int, int],
                    arms: dict[str, dict[str, Any]], full_ld: float, stale: bool) -> dict[str, Any]:
    """The skill's seam 0/1, no-rotation and control arms on the old-value prompt: each arm's field effect
    retained is written into ``arms``; with the stale control, the old value's full cache read as the new."""
    lm = ctx.lm
    o_ids, (c0, c1) = segment_prompt(lm.tokenizer, inst, inst.old_value, lm.has_chat_template, markers["policy"])
    end = len(o_ids) - 1
    compiled: Compiled = {}
    states = {f"seam{k}": splice_spans(lm, o_ids, [c0, c1], end, seam=k, compiled=compiled)
              for k in (0, 1) if f"seam{k}" in arms}
    if "no_rotation" in arms:
        states["no_rotation"] = splice_spans(lm, o_ids, [c0, c1], end, rotate=False, compiled=compiled)
    states |= _control_states(ctx, inst, o_ids, c0, c1, compiled)
    old_full = read_actions(lm, prefill(lm, o_ids[:-1]), o_ids[-1:], tokens).ld()
    out: dict[str, Any] = {"full_ld": old_full, "lds": {}}
    for name, rd in read_named(lm, states, o_ids[-1:], tokens, ctx.cfg.batch_size).items():
        out["lds"][name] = rd.ld()
        ret = field_effect_retained(arms[name]["ld"], rd.ld(), full_ld, old_full)
        if ret is not None:
            arms[name]["retained"] = ret
    if stale:  # the old value's full cache read for the new prompt (same query token): old full recompute's LD
        out["new_arms"] = {"seam0": arms["seam0"],
                           "stale": arm_entry(old_full, full_ld, field_effect_retained(old_full, old_full, full_ld,
                                                                                        old_full),
                                              agree=(old_full > 0) == (full_ld > 0))}
    return out


def agreement_by_direction(rows: list[dict[str, Any]], variant: str) -> dict[str, Any]:
    """A variant's decision agreement split by the direction of the value change, with Fisher's exact test
    of equal agreement when there are two directions. A chunk precompiled without the field misses the notes
    the field conditions; if the decision reads them, the spliced cache falls back to one action whatever
    the field says, and agreement then depends on the direction (it is high only where the full recompute
    takes that same action)."""
    from scipy.stats import fisher_exact

    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(str(r.get("direction")), []).append(r)
    by = {d: summarize_column(g, [bool(r[f"{variant}_agree"]) for r in g]) for d, g in sorted(groups.items())}
    out: dict[str, Any] = {"by_direction": by}
    if len(by) == 2:
        out["fisher_p"] = float(fisher_exact([[a["k"], a["n"] - a["k"]] for a in by.values()])[1])
    return out


def rotation_contrasts(rows: list[dict[str, Any]], seed: int = 0) -> dict[str, Any]:
    """Re-rotated minus unrotated, paired per instance, for every chunk spliced both ways (the skill: seam0
    vs no_rotation; the other chunks: <name>_seam0 vs <name>_no_rotation): decision agreement and logit cosine
    with full recompute. The control (no rotation) must be able to win: agreement alone does not measure the
    re-rotation when an unrotated splice decides the same (a constant-answer model)."""
    pairs = {"policy": ("seam0", "no_rotation")}
    pairs.update({k.removesuffix("_no_rotation_cosine"): (k.removesuffix("_no_rotation_cosine") + "_seam0",
                                                         k.removesuffix("_cosine"))
                  for k in rows[0] if k.endswith("_no_rotation_cosine") and k != "no_rotation_cosine"})
    return {chunk: {m: paired_contrast(rows, [r[f"{a}_{m}"] for r in rows], [r[f"{b}_{m}"] for r in rows], seed)
                    for m in ("agree", "cosine")}
            for chunk, (a, b) in pairs.items() if f"{a}_cosine" in rows[0]}


def summarize_rows(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, Any]:
    variants = [k.removesuffix("_cosine") for k in rows[0] if k.endswith("_cosine")]
    graded: dict[str, Any] = {}
    if any("graded" in r for r in rows):
        graded["graded"] = arms_summary([(r["scenario"], r["graded"]["arms"]) for r in rows if "graded" in r],
                                        ctx.cfg.seed)
    if any("controls" in r for r in rows):
        graded["controls"] = controls_summary([(r["scenario"], r["controls"]) for r in rows if "controls" in r],
                                              ctx.cfg.seed)
        if any("far_check" in r for r in rows):
            graded["far_check_max"] = max(r["far_check"] for r in rows if "far_check" in r)
            graded["far_distance_min"] = min(r["far_distance"] for r in rows if "far_distance" in r)
    return {**graded,
        "rotated_minus_unrotated": rotation_contrasts(rows, ctx.cfg.seed),
        "gate": ctx.scratch.get("gate"),
        "n_instances": len(rows),
        "full_accuracy": sum(r["full_correct"] for r in rows) / len(rows),
        "variants": {v: {"cosine": summarize_column(rows, [r[f"{v}_cosine"] for r in rows], seed=ctx.cfg.seed),
                         "agreement": summarize_column(rows, [bool(r[f"{v}_agree"]) for r in rows]),
                         **agreement_by_direction(rows, v)}
                     for v in variants},
    }


def table(summary: dict[str, Any]) -> str:
    lines = [f"instances {summary['n_instances']}, full-recompute accuracy {summary['full_accuracy']:.2f}; "
             f"RoPE gate {'passed' if summary['gate'] and summary['gate']['passed'] else 'FAILED'}",
             f"{'variant':<14}{'logit cosine vs full':<34}{'decision agreement':<30}"]
    for v, s in summary["variants"].items():
        c, a = s["cosine"], s["agreement"]
        lines.append(f"{v:<14}{ci_cell(c, 4):<34}{ci_cell(a, 3):<30}")
    seam0 = summary["variants"].get("seam0", {})
    for d, a in seam0.get("by_direction", {}).items():
        lines.append(f"  seam0 agreement, {d}: {a['k']}/{a['n']} {ci_cell(a, 2)}")
    if "fisher_p" in seam0:
        lines.append(f"  equal agreement in both directions: Fisher exact p {seam0['fisher_p']:.2g}")
    for chunk, c in summary.get("rotated_minus_unrotated", {}).items():
        lines.append(f"rotated - unrotated ({chunk}, paired): {_contrast_cell(c)}")
    if "graded" in summary:
        lines.append("graded, LD(new action - old) vs full recompute"
                     + (f"; no_rotation_far lands >= {summary['far_distance_min']} positions from its precompile, "
                        f"the re-rotated skill moved there vs in place max |dLD| {summary['far_check_max']:.1e} "
                        "(~0 if exact)" if "far_check_max" in summary else "") + ":")
        lines += graded_lines(summary["graded"], summary.get("controls"))
    return "\n".join(lines)


def _contrast_cell(c: dict[str, Any]) -> str:
    a, cos = c["agree"], c["cosine"]
    mc = a.get("mcnemar")
    return (f"agreement {ci_cell(a['difference'], 2, signed=True)} ({a['effect']['mean']:.2f} vs "
            f"{a['control']['mean']:.2f}" + (f"; McNemar {mc['effect_only']} vs {mc['control_only']}, p {mc['p']:.2g}"
                                             if mc else "") + f"), cosine {ci_cell(cos['difference'], 4, signed=True)}")


def headline(s: dict[str, Any]) -> str:
    v = s["variants"]
    cells = [f"{name} cos {ci_cell(v[name]['cosine'], 3)} agree {v[name]['agreement']['mean']:.2f}"
             for name in ("seam0", "no_rotation", "facts_seam0", "tools_seam0", "conversation_seam0",
                         "conversation_no_rotation")
             if name in v]
    seams = sorted((k for k in v if k.startswith("seam") and k != "seam0"), key=lambda k: int(k[4:]))
    if seams:
        cells.insert(1, f"{seams[-1]} cos {v[seams[-1]]['cosine']['mean']:.3f}")
    by = v.get("seam0", {}).get("by_direction")  # records written before the split have none
    if by:
        cells.insert(1, "seam0 agree by direction " + ", ".join(f"{d} {a['k']}/{a['n']}" for d, a in by.items())
                     + (f" (Fisher p {v['seam0']['fisher_p']:.2g})" if "fisher_p" in v["seam0"] else ""))
    rot = s.get("rotated_minus_unrotated", {}).get("policy")  # records written before the contrast have none
    if rot:
        cells.insert(0, f"rotated - unrotated (paired, n {rot['agree']['difference']['n']}): {_contrast_cell(rot)}")
    if s.get("controls"):
        cells.append(controls_headline(s["controls"]))
    return "; ".join(cells) + f"; full-recompute accuracy {s['full_accuracy']:.2f}"


EXPERIMENT = Experiment(name="transplant", doc=__doc__, needs_template=True, params=Params, run_instance=run_instance,
                        section="sec5",
                        summarize=summarize_rows, setup=setup, table=table, headline=headline,
                        paper=paper_headlines("transplant"),
                        claims=(Claim("skill_agreement", "transplanted skill decides as full recompute (instances the model "
                                      "decides correctly under full recompute)", "at_least",
                                      "seam0_agree", bound=KVPROBE_RATE_BOUND, gated=False,
                                      only="full_correct", role="effect", competence=("full_correct",)),
                                # The no-rotation arm passes the same test on every model: a control, not the effect.
                                Claim("skill_cosine", "transplanted skill's logit cosine above 0.90", "greater",
                                      "seam0_cosine", 0.90, gated=False, role="control", competence=("full_correct",)),
                                Claim("rotation_needed", "re-rotation is necessary: rotated + 1 seam token agrees "
                                      "with full recompute more than the unrotated transplant (paired)",
                                      "greater", "seam1_agree", "no_rotation_agree", gated=False,
                                      role="effect", competence=("full_correct",)),
                                Claim("seam_closes_gap", "one seam-repair token raises the transplant's logit cosine "
                                      "(paired)", "greater",
                                      "seam1_cosine", "seam0_cosine", gated=False, role="effect", competence=("full_correct",)),
                                near("blocks_keep_decisions", "four concurrent skill blocks decide as one (paired "
                                     "agreement difference ~ 0)", "blocks4_agree", 0.0, b="seam0_agree",
                                     gated=False, role="effect", competence=("full_correct",)),
                                # The paper's claim that the re-rotation is needed, as a paired
                                # contrast with its control: rotated minus unrotated on one instance (Fig. 9b).
                                      Claim("rotation_agreement_gain", "the re-rotated skill decides as full recompute more "
                                      "often than the unrotated one (paired)", "greater", "seam0_agree", "no_rotation_agree", gated=False, role="control", competence=("full_correct",)),
                                      Claim("rotation_cosine_gain", "the re-rotated skill's logits are closer to full "
                                      "recompute than the unrotated one's (paired)",
                                      "greater", "seam0_cosine", "no_rotation_cosine", gated=False, role="control", competence=("full_correct",)),
                                # Must-fail controls beside their treatment, graded (no competent model needed), by
                                # kvprobe's own margins: rows of records run with the controls.
                                Claim("far_rotation_separation", "the skill spliced without re-rotation >= 2,000 "
                                      "positions from its precompile is further from full recompute's LD than the "
                                      "re-rotated skill there, by more than kvprobe's margin "
                                      f"({SEPARATION_MARGIN} nats)", "greater", "controls.no_rotation_far.separation",
                                      SEPARATION_MARGIN, gated=False, role="control"),
                                Claim("stale_retained_separation", "the transplanted skill retains more of full "
                                      "recompute's response to the field than the stale cache, by more than "
                                      f"kvprobe's margin ({RETAINED_MARGIN})", "greater",
                                      "controls.stale.retained_separation", RETAINED_MARGIN, gated=False,
                                      role="control")))
