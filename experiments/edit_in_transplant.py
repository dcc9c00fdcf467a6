"""Editing inside a transplant: every edit method of ``edit_frontier`` applied to a field that lives inside a
precompiled, re-rotated chunk, against the same method on a normally prefilled context (paper Section 6,
Figure 7a: "composed ~ recomputed for every method; points on the diagonal").

Per instance the chunk is the context's SESSION CONTEXT (which holds the mutable field) through the POLICY
DOCUMENT (the rule that reads it): the skill with a field in its body. It is precompiled alone at positions
0..L-1 with the OLD value, re-rotated to where it lands after the preamble, and the rest of the prompt is
prefilled over it: that is the composed stale cache. Every method then edits the field in both caches, the
normal stale cache (a full prefill of the old context) and the composed one, with the same operations of
:mod:`kvprobe.kv.edit`: stale, in_place, field+selective@K (the K downstream slots of highest causal effect,
ranked once on the normal pair and used for both caches), full_downstream, erratum, field+erratum and full
reprefill. Each method's decision (the argmax of the two action tokens) and its recovery between the
instance's NORMAL stale and oracle anchors are recorded for both caches, so "on the diagonal" is read per
method as the rate at which the composed and the normal cache decide alike, and the paired recovery
difference. Full reprefill does not read either stale cache: it is the same state on both sides (an
identity, recorded as a check).

The control: the same chunk spliced WITHOUT re-rotation (keys left at their isolated positions) under the
erratum method, which must decide like the normal cache less often than the rotated chunk does, or the
diagonal says nothing about the splice.

Graded measures and must-fail controls (:mod:`kvprobe.probes.graded`): every path x method's LD (new action
minus old, nats), its distance from full reprefill's, and its *field effect retained* ((LD - the path's own stale
LD) over the normal anchors' flip, undefined below 0.5 nats of flip), read even where every decision is the same.
Beside the composed erratum stand the controls that must fail, with the separation (LD error; retained) and its
cluster CI: ``stale`` (the composed stale cache: retained 0), ``no_rotation`` (the chunk above, unrotated) and,
with ``controls: [no_rotation_far]``, the whole composed context moved ``far_offset`` positions up with the chunk
spliced there unrotated (treatment: the re-rotated chunk there, under the erratum).

Where our setting differs: small CPU models and the gated template (the paper uses Gemma-2-9B and
Llama-3.1-8B); the chunk sits early (after the preamble), so the no-rotation control moves keys by only the
preamble's length.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvprobe.claims import ACCURACY_MARGIN, RECOVERY_MARGIN, RETAINED_MARGIN, SEPARATION_MARGIN, Claim
from kvprobe.kv import edit
from kvprobe.kv.compose import Live, Spliced, assemble, precompile
from kvprobe.kv.edit import FieldEdit
from kvprobe.patching.pairs import measure
from kvprobe.patching.ranking import rank_downstream
from kvprobe.probes.edit_summary import (base_row, edit_case, edit_gate_summary, method_entry, read_ld)
from kvprobe.probes.graded import (FAR_OFFSET, arm_entry, arms_summary, control_entry, controls_summary, far_check,
                                   field_effect_retained, graded_lines, pick)
from kvprobe.schema import hash_neutral
from kvprobe.probes.summary import ci_cell, scenarios, which
from kvprobe.runner.experiment import Context, Experiment
from kvprobe.stats.bootstrap import summarize
from kvprobe.stats.inference import mcnemar_exact, summarize_proportion
from kvprobe.tasks.edits import erratum_body, erratum_line, prompt_ids
from kvprobe.tasks.gated import segment_prompt
from kvprobe.paper import headlines as paper_headlines

PATHS = ("normal", "composed")


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    chunk: Literal["facts", "facts_policy"] = Field(
        "facts_policy", description="the precompiled chunk: the session context alone, or through the policy")
    selective_k: list[int] = Field(default_factory=lambda: [4, 16, 32],
                                   description="K of field+selective@K (K above the downstream length: skipped)")
    erratum_wording: str | None = Field(None, description="over {field}, {new_value}; null: the template's erratum")
    controls: list[str] = hash_neutral([], description="opt-in must-fail controls: no_rotation_far (the composed "
                                       "context moved far_offset positions up, the chunk not re-rotated; erratum)")
    far_offset: int = hash_neutral(FAR_OFFSET, ge=2000, description="no_rotation_far: the context moved this many "
                                   "positions up (the chunk lands >= this far from where it was precompiled)")

    @field_validator("controls")
    @classmethod
    def _controls(cls, v: list[str]) -> list[str]:
        return pick(v, ["no_rotation_far"], "controls")


def method_names(params: Params) -> list[str]:
    return ["stale", "in_place", *(f"selective@{k}" for k in params.selective_k), "full_downstream", "erratum",
            "field_erratum", "full_reprefill"]


def _chunk_bounds(ctx: Context, inst: Any, ids: list[int]) -> tuple[int, int]:
    tpl = ctx.template
    end = tpl.policy_header if ctx.params.chunk == "facts" else tpl.tools_header
    got, (c0, c1) = segment_prompt(ctx.lm.tokenizer, inst, inst.old_value, ctx.lm.has_chat_template,
                                   [tpl.context_header, end])
    if got[: len(ids)] != ids:
        raise ValueError(f"instance {inst.index}: the segmented prompt differs from the tokenized pair")
    return c0, c1


def _composed_stale(ctx: Context, e: FieldEdit, c0: int, c1: int, rotate: bool = True, start: int = 0) -> FieldEdit:
    """The old context with [c0, c1) precompiled alone and spliced (re-rotated unless ``rotate`` is False; the
    context moved ``start`` positions up)."""
    ids = e.stale_ids
    chunk = ids[c0:c1]
    state = assemble(ctx.lm, [Live(tuple(ids[:c0])), Spliced(tuple(chunk), precompile(ctx.lm, chunk), rotate=rotate),
                              Live(tuple(ids[c1:]))], start)
    return replace(e, stale=state)


def _methods(ctx: Context, e: FieldEdit, ranked: list[int], ks: list[int], erratum_ids: dict[str, list[int]],
             r: int) -> dict[str, Any]:
    lm = ctx.lm
    return {"stale": edit.stale(e), "in_place": edit.in_place(lm, e),
            **{f"selective@{k}": edit.field_selective(lm, e, ranked, k) for k in ks},
            "full_downstream": edit.full_downstream(lm, e),
            "erratum": edit.erratum(lm, e, erratum_ids["erratum"], r),
            "field_erratum": edit.field_erratum(lm, e, erratum_ids["field_erratum"], r),
            "full_reprefill": edit.full_reprefill(lm, e)}


def run_instance(ctx: Context, inst: Any) -> dict[str, Any]:
    lm, p, tok, chat, r = ctx.lm, ctx.params, ctx.lm.tokenizer, ctx.lm.has_chat_template, 1
    c = edit_case(ctx, inst, r)
    pair, pp, normal = c.pair, c.pp, c.edit
    c0, c1 = _chunk_bounds(ctx, inst, pair.ids_old)
    if not (c0 <= normal.field_slots[0] and normal.field_slots[-1] < c1):
        raise ValueError(f"instance {inst.index}: the field is not inside the chunk [{c0}, {c1})")
    composed = _composed_stale(ctx, normal, c0, c1)
    ks = [k for k in p.selective_k if k <= len(pp.downstream_slots)]
    # the causal-effect ranking reads one patched cache per downstream slot: the costliest step, run only if used
    ranked = rank_downstream(lm, pp, c.anchor).positions if ks else []
    line = erratum_line(ctx.template, inst, inst.new_value, p.erratum_wording)
    erratum_ids = {"erratum": prompt_ids(tok, inst, erratum_body(ctx.template, inst, inst.old_value, [line]), chat),
                   "field_erratum": prompt_ids(tok, inst, erratum_body(ctx.template, inst, inst.new_value, [line]),
                                               chat)}
    results = {path: _methods(ctx, e, ranked, ks, erratum_ids, r) for path, e in (("normal", normal),
                                                                                  ("composed", composed))}
    # in-context methods read the pair's suffix: one batched readout with the anchors they are normalized by
    in_context = {f"{path}/{n}": res.state for path, rs in results.items() for n, res in rs.items()
                  if res.suffix_ids == pp.suffix and n not in ("erratum", "field_erratum")}
    anchor, lds, _ = measure(lm, pp, in_context, ctx.cfg.batch_size)
    c = replace(c, anchor=anchor)
    row: dict[str, Any] = {**base_row(ctx, inst, c), "chunk": [c0, c1], "n_downstream": len(pp.downstream_slots),
                           "erratum_text": line}
    for path, rs in results.items():
        row[path] = {}
        for n, res in rs.items():
            ld = lds[f"{path}/{n}"] if f"{path}/{n}" in lds else read_ld(lm, pair, res.state, res.suffix_ids)
            row[path][n] = method_entry(anchor, ld, res)
    # the control: the chunk spliced without re-rotation, under the erratum
    unrotated = _composed_stale(ctx, normal, c0, c1, rotate=False)
    res = edit.erratum(lm, unrotated, erratum_ids["erratum"], r)
    row["no_rotation"] = {"erratum": method_entry(anchor, read_ld(lm, pair, res.state, res.suffix_ids), res)}
    stale_lds = {"normal": row["normal"]["stale"]["ld"], "composed": row["composed"]["stale"]["ld"],
                 "no_rotation": read_ld(lm, pair, unrotated.stale, unrotated.suffix)}
    row["agree"] = {n: row["composed"][n]["correct"] == row["normal"][n]["correct"] for n in row["composed"]}
    row["agree"]["no_rotation_erratum"] = row["no_rotation"]["erratum"]["correct"] == row["normal"]["erratum"]["correct"]
    row["checks"] = {"stale_composed_vs_normal_max_abs": composed.stale.max_abs_diff(normal.stale),
                     "full_reprefill_ld_gap": abs(lds["composed/full_reprefill"] - lds["normal/full_reprefill"])}
    if "no_rotation_far" in p.controls:  # the composed context moved far up: the chunk re-rotated there, and not
        for name, rotate in (("composed_far", True), ("no_rotation_far", False)):
            far_e = _composed_stale(ctx, normal, c0, c1, rotate, p.far_offset)
            far = edit.erratum(lm, far_e, erratum_ids["erratum"], r)
            row[name] = {"erratum": method_entry(anchor, read_ld(lm, pair, far.state, far.suffix_ids), far)}
            stale_lds[name] = read_ld(lm, pair, far_e.stale, far_e.suffix)
        row["far_check"] = far_check(row["composed_far"]["erratum"]["ld"], row["composed"]["erratum"]["ld"])
        row["far_distance"] = p.far_offset + c0
    row["path_stale_ld"] = stale_lds
    row.update(_graded(row, anchor))
    return row


def _graded(row: dict[str, Any], anchor: Any) -> dict[str, Any]:
    """Every path x method's LD, its distance from full reprefill's (the oracle) and its field effect retained:
    (LD - the path's own stale LD) / (oracle - normal stale), undefined below the floor (so each path's stale
    cache retains 0); the controls beside the composed erratum, and each path's stale cache as an arm."""
    paths = [p for p in ("normal", "composed", "no_rotation", "composed_far", "no_rotation_far") if p in row]
    stale = row["path_stale_ld"]
    arms = {f"{path}_{m}": arm_entry(e["ld"], anchor.oracle_ld,
                                     field_effect_retained(e["ld"], stale[path], anchor.oracle_ld, anchor.stale_ld),
                                     agree=(e["ld"] > 0) == (anchor.oracle_ld > 0))
            for path in paths for m, e in row[path].items()}
    controls = {"stale": control_entry("composed_erratum", arms, "composed_stale"),
                "no_rotation": control_entry("composed_erratum", arms, "no_rotation_erratum")}
    if "no_rotation_far_erratum" in arms:
        controls["no_rotation_far"] = control_entry("composed_far_erratum", arms, "no_rotation_far_erratum")
    return {"graded": {"arms": arms}, "controls": controls}


def summarize_rows(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = edit_gate_summary(ctx, rows)
    over = [r for r in rows if r["included"]] if out["n_included"] else rows
    clusters = scenarios(over)
    methods: dict[str, Any] = {}
    for name in method_names(ctx.params):
        have = [r for r in over if name in r["composed"]]
        if not have:
            continue
        cl = scenarios(have)
        block = {path: {"p_correct": summarize_proportion([bool(r[path][name]["correct"]) for r in have], cl),
                        "recovery": summarize([r[path][name]["recovery"] for r in have], seed=ctx.cfg.seed,
                                              clusters=cl),
                        "recompute_fraction": sum(r[path][name]["recompute_fraction"] for r in have) / len(have)}
                 for path in PATHS}
        block["agreement"] = summarize_proportion([bool(r["agree"][name]) for r in have], cl)
        block["recovery_gap"] = summarize([r["composed"][name]["recovery"] - r["normal"][name]["recovery"]
                                           for r in have], seed=ctx.cfg.seed, clusters=cl)
        mc = mcnemar_exact([bool(r["composed"][name]["correct"]) for r in have],
                           [bool(r["normal"][name]["correct"]) for r in have])
        block["mcnemar_composed_vs_normal"] = mc
        methods[name] = block
    control = summarize_proportion([bool(r["agree"]["no_rotation_erratum"]) for r in over], clusters)
    if any("graded" in r for r in rows):  # graded: over every instance (readable where none passes the gate)
        out["graded"] = arms_summary([(r["scenario"], r["graded"]["arms"]) for r in rows if "graded" in r],
                                     ctx.cfg.seed)
        out["controls"] = controls_summary([(r["scenario"], r["controls"]) for r in rows if "controls" in r],
                                           ctx.cfg.seed)
        if any("far_check" in r for r in rows):
            out["far_check_max"] = max(r["far_check"] for r in rows if "far_check" in r)
            out["far_distance_min"] = min(r["far_distance"] for r in rows if "far_distance" in r)
    return {**out, "methods": methods, "no_rotation_erratum": {
        "agreement": control,
        "p_correct": summarize_proportion([bool(r["no_rotation"]["erratum"]["correct"]) for r in over], clusters)},
        "checks_max": {k: max(r["checks"][k] for r in rows) for k in rows[0]["checks"]}}


def table(summary: dict[str, Any]) -> str:
    w = which(summary)
    lines = [f"instances {summary['n_instances']}, included {summary['n_included']} (columns over {w} instances); "
             "normal = full prefill of the old context, composed = chunk precompiled alone and spliced",
             f"{'method':<16}{'P(correct) normal':<22}{'composed':<22}{'recovery normal':<24}{'composed':<24}"
             f"{'agree':<20}"]
    # recovery divides by the oracle's flip: undefined where no instance passes the gate
    rec = ci_cell if summary["n_included"] else (lambda stat: "n/a (no gate)")
    for name, b in summary["methods"].items():
        lines.append(f"{name:<16}{ci_cell(b['normal']['p_correct']):<22}{ci_cell(b['composed']['p_correct']):<22}"
                     f"{rec(b['normal']['recovery']):<24}{rec(b['composed']['recovery']):<24}"
                     f"{ci_cell(b['agreement']):<20}")
    ctl = summary["no_rotation_erratum"]
    lines.append(f"control: no-rotation chunk + erratum agrees with normal erratum {ci_cell(ctl['agreement'])} "
                 f"(P(correct) {ci_cell(ctl['p_correct'])})")
    lines.append("checks (max): " + ", ".join(f"{k} {v:.1e}" for k, v in summary["checks_max"].items()))
    if "graded" in summary:
        lines.append("graded over all instances (LD new - old action vs full reprefill; retained = the LD change "
                     "from the path's own stale cache over the normal flip)" + (f"; no_rotation_far lands >= {summary['far_distance_min']} positions "
                                              f"from its precompile, the re-rotated chunk moved there vs in place max "
                                              f"|dLD| {summary['far_check_max']:.1e} (~0 if exact)"
                                              if "far_check_max" in summary else "") + ":")
        lines += graded_lines(summary["graded"], summary.get("controls"))
    return "\n".join(lines)


def headline(s: dict[str, Any]) -> str:
    m = s["methods"]
    control = f"control no-rotation+erratum agree {s['no_rotation_erratum']['agreement']['mean']:.2f}"
    if not s["n_included"]:
        # recovery divides by the oracle's flip, which is below the gate on every instance: only agreement reads
        cells = [f"{n} {m[n]['agreement']['mean']:.2f}" for n in m if n != "full_reprefill"]
        return ("no instance gates (recovery undefined); composed agrees with normal: " + "; ".join(cells)
                + f"; {control}; over all (n {s['n_instances']})")
    cells = [f"{n} rec {m[n]['normal']['recovery']['mean']:+.2f}/{m[n]['composed']['recovery']['mean']:+.2f} "
             f"agree {m[n]['agreement']['mean']:.2f}" for n in m if n != "full_reprefill"
             and m[n]['normal']['recovery'].get('mean') is not None]
    return "normal/composed: " + "; ".join(cells) + f"; {control}; over gated (n {s['n_included']})"


def _diagonal(name: str, **declared: str) -> Claim:
    return Claim(f"diagonal_{name.replace('@', '_')}", f"composed decides as normal under {name}", "agrees",
                 f"composed.{name}.correct", f"normal.{name}.correct", bound=1 - ACCURACY_MARGIN, **declared, competence=("oracle_correct",))


EXPERIMENT = Experiment(
    section="sec6", section_order=1,
    name="edit_in_transplant", doc=__doc__, needs_template=True, params=Params, run_instance=run_instance,
    summarize=summarize_rows, table=table, headline=headline,
    paper=paper_headlines("edit_in_transplant"),
    claims=(
        _diagonal("in_place", role="effect"),
        _diagonal("selective@32", role="effect"),
        _diagonal("erratum", role="effect"),
        _diagonal("field_erratum", role="effect"),
        # the selective arm: the study runs selective_k at its default on both organisms
        Claim("diagonal_recovery_selective_32", "composed recovery equals normal under selective@32", "equivalent",
              "composed.selective@32.recovery", "normal.selective@32.recovery",
              bounds=(-RECOVERY_MARGIN, RECOVERY_MARGIN), role="effect", competence=("oracle_correct",)),
        Claim("composed_erratum_beats_in_place", "inside a transplant, erratum beats in_place P(correct)", "greater", "composed.erratum.correct",
              "composed.in_place.correct", role="effect", competence=("oracle_correct",)),
        Claim("no_rotation_control", "the rotated chunk decides as normal more often than the unrotated one", "greater", "agree.erratum", "agree.no_rotation_erratum",
              gated=True, role="control", competence=("oracle_correct",)),
        # Must-fail controls beside the composed erratum, graded over every instance (no competent model needed), by
        # kvprobe's own margins: the stale cache retains 0 of the field effect by construction.
        Claim("stale_retained_separation", "the composed erratum retains more of full reprefill's response to the "
              f"field than the composed stale cache, by more than kvprobe's margin ({RETAINED_MARGIN})", "greater",
              "controls.stale.retained_separation", RETAINED_MARGIN, gated=False, role="control"),
        Claim("far_rotation_separation", "the chunk spliced without re-rotation >= 2,000 positions from its precompile "
              "is further from full reprefill's LD under the erratum than the re-rotated chunk there, by more than "
              f"kvprobe's margin ({SEPARATION_MARGIN} nats)", "greater", "controls.no_rotation_far.separation",
              SEPARATION_MARGIN, gated=False, role="control"),
    ))
