"""Weight edit: KV editing vs weight editing for mutable per-request state (paper Table 1, Appendix I).

The target is one request of the gated task whose field changed (order_status pending -> shipped, so the
action goes cancel -> deny) while its stale cache or its stale context is all the system holds. Each method
must make that request decide the new action:

- KV edits over the request's own cache (:mod:`kvprobe.kv.edit`): in_place, erratum, field+erratum;
- ROME (:mod:`kvprobe.edits.rome`): the subject is the field's value in the record, its key ``k*`` the
  mid-layer ``down_proj`` input at the value's last token, ``v*`` optimised (with a KL term on the essence
  prompt ``"{field}: {value} is a"``) so the stale context decides the new action, and the closed-form rank-one
  update written into the weights; the key covariance is one pass over a stated neutral text sample;
- LoRA (:mod:`kvprobe.edits.lora`): r = 8 on q, v and down, fine-tuned on the stale context with the new
  action as the label until the decision flips.

Four measures for every method, on the same target: efficacy (the target decides the new action);
cross-request contamination (the fraction of 8 held-out requests of the same field, genuinely still at the
old value so their correct answer is the un-edited one, that the same model instance now decides with the
new action); collateral damage (the fraction of a 10-item battery of unrelated gated decisions, other
scenarios, whose decision changes against the un-edited model); and edit latency, from the stale cache held
to the decision logits (a weight edit must also reprefill the request: the cache of the old weights is
invalid), timed side by side in one run and reported as ratios to the erratum. Plus the rollback (its cost,
and whether the weights come back byte-identical by checksum) and the two-request test (one instance serves
the edited request and a held-out old-value request: both right?).

Identities, labelled as such: a KV edit leaves the weights unchanged (checked by checksum on every target),
so its contamination and collateral are 0 by construction: the other requests are served by the same,
unchanged weights with their own caches, and its rollback is dropping the edited cache.

Where our setting differs: small CPU models; the paper's battery of "unrelated single-token gated decisions"
is here the task's other scenarios in the same prompt shape; ROME uses the request prompt without sampled
context prefixes and a ridge on the covariance (the text sample holds fewer tokens than the key dimension).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvprobe.backends import HookableModel
from kvprobe.claims import ACCURACY_MARGIN, Claim
from kvprobe.edits import lora, rome
from kvprobe.edits.weights import weights_checksum
from kvprobe.kv import edit
from kvprobe.kv.readout import prefill, read_logits
from kvprobe.probes.edit_summary import base_row, edit_case, edit_gate_summary, read_ld
from kvprobe.probes.summary import ci_cell, scenarios
from kvprobe.runner.experiment import Context, Experiment
from kvprobe.stats.bootstrap import summarize
from kvprobe.stats.inference import summarize_proportion
from kvprobe.tasks.edits import erratum_body, erratum_line, prompt_ids
from kvprobe.tasks.gated import build_instance, load_template, tokenize_pair
from kvprobe.paper import headlines as paper_headlines

KV_METHODS = ("in_place", "erratum", "field_erratum")
WEIGHT_METHODS = ("rome", "lora")
METHODS = (*KV_METHODS, *WEIGHT_METHODS)
NEUTRAL_TEXT = Path(__file__).resolve().parents[1] / "kvprobe" / "organism" / "data" / "neutral.txt"


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    scenario: str = Field("order_status", description="the template scenario of the target and held-out requests")
    n_heldout: int = Field(8, ge=1, description="held-out requests at the old value (contamination)")
    n_collateral: int = Field(10, ge=1, description="unrelated gated decisions, other scenarios (collateral)")
    format: Literal["system_user", "user_turn", "document_qa", "few_shot", "tool_call", "gated_template", "email"] | None = Field(
        None, description="a generator format (kvprobe.tasks.generator.FORMATS) to render the "
                               "template's scenarios in, e.g. document_qa for the v3 organisms; null: the template")
    split: str = Field("test", description="generator split of the note and framing words (with format)")
    n_notes: int | None = Field(None, ge=0, description="note lines of a generated instance (null: the generator's)")
    rome_layer: int | None = Field(None, description="layer whose down_proj ROME edits (null: n_layers // 2)")
    rome_steps: int = Field(20, ge=1)
    rome_lr: float = 0.5
    rome_kl_weight: float = 0.0625
    rome_ridge: float = Field(1e-4, ge=0, description="ridge on C, in units of tr(C)/d")
    lora_r: int = 8
    lora_lr: float = 1e-3
    lora_max_steps: int = 40
    lora_margin: float = Field(1.0, description="nats the new action must lead by for the LoRA edit to stop")


def _layer(ctx: Context) -> int:
    return ctx.params.rome_layer if ctx.params.rome_layer is not None else ctx.lm.spec.n_layers // 2


def _build(ctx: Context, scenario: Any, i: int) -> Any:
    from kvprobe.tasks.generator import build_generated, template_family

    if ctx.params.format is None:
        return build_instance(ctx.template, scenario, i, ctx.cfg.seed, ctx.cfg.task.n_filler)
    return build_generated(i, ctx.cfg.seed, ctx.params.split, ctx.params.format, tokenizer=ctx.lm.tokenizer,
                           chat=ctx.lm.has_chat_template, counterfactual=0.0, family=template_family(scenario),
                           n_notes=ctx.params.n_notes)


def make_instances(ctx: Context) -> list[Any]:
    """Targets (the scenario's allow -> block changes), then held-out requests of the same scenario at the
    allow value, then the collateral battery from the other scenarios (kept in ``ctx.scratch``)."""
    ctx.template = load_template(ctx.cfg.task.template)
    main = ctx.template.scenario(ctx.params.scenario)
    want = ctx.cfg.task.n_instances + ctx.params.n_heldout
    pool, i = [], 0
    while len(pool) < want and i < 50 * want:
        inst = _build(ctx, main, i)
        if inst.old_value == main.allow_value:  # pending -> shipped: cancel -> deny
            pool.append(inst)
        i += 1
    others = [s for s in ctx.template.scenarios if s.name != main.name]
    ctx.scratch["heldout"] = pool[ctx.cfg.task.n_instances:]
    ctx.scratch["collateral"] = [_build(ctx, others[j % len(others)], 10_000 + j)
                                 for j in range(ctx.params.n_collateral)]
    return pool[: ctx.cfg.task.n_instances]


def _decision(lm: HookableModel, inst: Any) -> dict[str, Any]:
    """The request at its old value: logit difference (old action minus new action) and its decision."""
    pair = tokenize_pair(lm.tokenizer, inst, lm.has_chat_template)
    _, logits = prefill(lm, pair.ids_old, return_logits=True)
    ld = float(logits[0, pair.old_action_id] - logits[0, pair.new_action_id])
    return {"ld_old_minus_new": ld, "old_action": ld > 0}


def _batteries(lm: HookableModel, ctx: Context) -> dict[str, list[dict[str, Any]]]:
    return {name: [_decision(lm, inst) for inst in ctx.scratch[name]] for name in ("heldout", "collateral")}


def _neutral_sample(ctx: Context) -> list[list[int]]:
    """The stated text sample for ROME's key covariance: the project's neutral passage and the gated
    template's filler rules (policy boilerplate unrelated to any field)."""
    tok = ctx.lm.tokenizer
    texts = [NEUTRAL_TEXT.read_text(), "\n".join(ctx.template.filler_rules)]
    return [tok(t)["input_ids"] for t in texts]


def setup(ctx: Context) -> None:
    ctx.scratch["baseline"] = _batteries(ctx.lm, ctx)
    ctx.scratch["checksum"] = weights_checksum(ctx.lm)
    cov = rome.key_covariance(ctx.lm, _layer(ctx), _neutral_sample(ctx))
    ctx.scratch["cov"] = cov
    ctx.scratch["cov_info"] = {"layer": cov.layer, "tokens": cov.n_tokens, "seconds": cov.seconds,
                               "text": "kvprobe/organism/data/neutral.txt + the gated template's filler rules"}


def _spread(ctx: Context, after: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    base = ctx.scratch["baseline"]
    held = [b["old_action"] and not a["old_action"] for b, a in zip(base["heldout"], after["heldout"])]
    right = [b["old_action"] for b in base["heldout"]]
    changed = [b["old_action"] != a["old_action"] for b, a in zip(base["collateral"], after["collateral"])]
    return {"contamination": sum(held) / max(1, sum(right)),  # of the held-out the un-edited model gets right
            "collateral": sum(changed) / len(changed),
            "heldout_first_correct": after["heldout"][0]["old_action"]}


def run_instance(ctx: Context, inst: Any) -> dict[str, Any]:
    lm, p = ctx.lm, ctx.params
    c = edit_case(ctx, inst, 1)
    pair, e = c.pair, c.edit
    line = erratum_line(ctx.template, inst, inst.new_value)  # a generated instance: the generator's correction
    ids = {name: prompt_ids(lm.tokenizer, inst, erratum_body(ctx.template, inst, v, [line]), lm.has_chat_template)
           for name, v in (("erratum", inst.old_value), ("field_erratum", inst.new_value))}
    kv_ops = {"in_place": lambda: edit.in_place(lm, e), "erratum": lambda: edit.erratum(lm, e, ids["erratum"], 1),
              "field_erratum": lambda: edit.field_erratum(lm, e, ids["field_erratum"], 1)}
    methods: dict[str, dict[str, Any]] = {}
    for name, op in kv_ops.items():
        t0 = time.perf_counter()
        res = op()
        ld = read_ld(lm, pair, res.state, res.suffix_ids)
        latency = time.perf_counter() - t0
        t1 = time.perf_counter()
        del res  # rollback of a KV edit: drop the request's edited cache
        methods[name] = {"ld": ld, "efficacy": ld > 0, "latency_s": latency, "rollback_s": time.perf_counter() - t1}
    unchanged = weights_checksum(lm) == ctx.scratch["checksum"]
    for name in KV_METHODS:  # identity: the weights are those of the un-edited model, so nothing else moves
        methods[name].update(weights_unchanged=unchanged, contamination=0.0, collateral=0.0, rollback_exact=unchanged,
                             heldout_first_correct=ctx.scratch["baseline"]["heldout"][0]["old_action"],
                             identity=True)

    def weight_method(name: str, apply_edit: Any) -> None:
        t0 = time.perf_counter()
        handle = apply_edit()
        edit_s = time.perf_counter() - t0
        ld = read_ld(lm, pair, prefill(lm, pair.ids_old[:-1]), pair.ids_old[-1:])  # reprefill: old cache is stale
        latency = time.perf_counter() - t0
        spread = _spread(ctx, _batteries(lm, ctx))
        t1 = time.perf_counter()
        handle.rollback(lm) if name == "rome" else handle.rollback()
        rollback_s = time.perf_counter() - t1
        methods[name] = {"ld": ld, "efficacy": ld > 0, "latency_s": latency, "edit_s": edit_s,
                         "rollback_s": rollback_s, "rollback_exact": weights_checksum(lm) == ctx.scratch["checksum"],
                         "weights_unchanged": False, "identity": False, **spread, "detail": handle.detail}

    layer = _layer(ctx)
    target = rome.SubjectPrompt(tuple(pair.ids_old), pair.field_slots[-1])
    essence = rome.subject_prompt(lm.tokenizer, f"{inst.field}: {inst.old_value} is a", inst.old_value)
    weight_method("rome", lambda: rome.rome_edit(lm, layer, [target], [pair.new_action_id], ctx.scratch["cov"],
                                                 [essence], ridge=p.rome_ridge, steps=p.rome_steps, lr=p.rome_lr,
                                                 kl_weight=p.rome_kl_weight))
    weight_method("lora", lambda: lora.lora_edit(lm, [pair.ids_old], pair.new_action_id, pair.old_action_id, r=p.lora_r,
                                                 lr=p.lora_lr, max_steps=p.lora_max_steps, margin=p.lora_margin,
                                                 seed=ctx.cfg.seed + inst.index))
    for name in METHODS:
        methods[name]["two_requests_correct"] = bool(methods[name]["efficacy"]
                                                     and methods[name]["heldout_first_correct"])
    return {**base_row(ctx, inst, c), "erratum_text": line, "rome_layer": layer, "methods": methods}


def summarize_rows(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = edit_gate_summary(ctx, rows)
    use = [r for r in rows if r["included"]] or rows
    clusters = scenarios(use)
    ref = [r["methods"]["erratum"]["latency_s"] for r in use]
    out["methods"] = {}
    for name in METHODS:
        col = lambda k, name=name: [r["methods"][name][k] for r in use]  # noqa: E731
        lat = col("latency_s")
        out["methods"][name] = {
            "efficacy": summarize_proportion([bool(v) for v in col("efficacy")], clusters),
            "contamination": summarize(col("contamination"), seed=ctx.cfg.seed, clusters=clusters),
            "collateral": summarize(col("collateral"), seed=ctx.cfg.seed, clusters=clusters),
            "two_requests_correct": summarize_proportion([bool(v) for v in col("two_requests_correct")], clusters),
            "latency_s_median": statistics.median(lat),
            "latency_x_erratum_median": statistics.median(a / b for a, b in zip(lat, ref)),
            "rollback_s_median": statistics.median(col("rollback_s")),
            "rollback_exact": all(col("rollback_exact")),
            "weights_unchanged": all(col("weights_unchanged")),
            "identity": name in KV_METHODS,
        }
    out["covariance"] = ctx.scratch.get("cov_info")
    base = ctx.scratch.get("baseline", {})
    out["unedited"] = {k: {"n": len(v), "old_action": sum(d["old_action"] for d in v)} for k, v in base.items()}
    return out


def table(s: dict[str, Any]) -> str:
    lines = [f"instances {s['n_instances']}, included {s['n_included']} (columns over {s['summary_over']}); "
             f"un-edited model: held-out old action {s['unedited']['heldout']['old_action']}/"
             f"{s['unedited']['heldout']['n']}; ROME covariance {s['covariance']['tokens']} tokens, "
             f"{s['covariance']['seconds']:.2f} s, layer {s['covariance']['layer']}",
             f"{'method':<15}{'efficacy':<22}{'contamination':<24}{'collateral':<24}{'x erratum':>10}"
             f"{'rollback s':>11}  exact"]
    no_interval = False
    for name, m in s["methods"].items():
        tag = " (identity)" if m["identity"] else ""
        cells = [ci_cell(m[k]) for k in ("contamination", "collateral")]
        no_interval |= any("(no CI" in c for c in cells)
        cont, coll = (c.split(" (no CI", 1)[0] + ("*" if "(no CI" in c else "") for c in cells)
        lines.append(f"{name:<15}{ci_cell(m['efficacy']):<22}{cont + tag:<24}"
                     f"{coll + tag:<24}{m['latency_x_erratum_median']:>10.2f}"
                     f"{m['rollback_s_median']:>11.4f}  {m['rollback_exact']}")
    if no_interval:  # the targets share one scenario: a scenario-cluster interval needs several
        lines.append("* no interval: every target is the same scenario (one cluster)")
    return "\n".join(lines)


def headline(s: dict[str, Any]) -> str:
    m = s["methods"]
    return "; ".join(f"{n} flips {m[n]['efficacy']['mean']:.2f}, contam {m[n]['contamination']['mean']:.2f}, "
                     f"collat {m[n]['collateral']['mean']:.2f}, {m[n]['latency_x_erratum_median']:.1f}x erratum"
                     for n in ("field_erratum", "in_place", "rome", "lora")) + " (KV contam/collat: identity)"


EXPERIMENT = Experiment(
    section="sec9",
    name="weight_edit", doc=__doc__, params=Params, run_instance=run_instance, summarize=summarize_rows,
    make_instances=make_instances, setup=setup, table=table, headline=headline,
    paper=paper_headlines("weight_edit"),
    claims=(
      
        Claim("weight_edit_field_erratum_flips", "field+erratum flips the target decision",
              "at_least", "methods.field_erratum.efficacy", bound=0.5, role="effect", competence=("oracle_correct",)),
      
        Claim("weight_edit_rome_flips", "ROME flips the target decision", "at_least",
              "methods.rome.efficacy", bound=0.5, role="effect", competence=("oracle_correct",)),
      
        Claim("weight_edit_lora_flips", "LoRA flips the target decision", "at_least",
              "methods.lora.efficacy", bound=0.5, role="effect", competence=("oracle_correct",)),
      
        Claim("weight_edit_rome_contaminates", "ROME contaminates held-out requests more than field+erratum", "greater", "methods.rome.contamination", "methods.field_erratum.contamination", role="effect", competence=("oracle_correct",)),
      
        Claim("weight_edit_lora_contaminates", "LoRA contaminates held-out requests more than field+erratum", "greater", "methods.lora.contamination", "methods.field_erratum.contamination", role="effect", competence=("oracle_correct",)),
      
        Claim("weight_edit_rome_collateral", "ROME changes unrelated decisions more than field+erratum", "greater", "methods.rome.collateral", "methods.field_erratum.collateral", role="effect", competence=("oracle_correct",)),
      
        Claim("weight_edit_rome_slower", "a ROME edit takes longer than the erratum (side by side, one run)", "greater", "methods.rome.latency_s", "methods.erratum.latency_s", role="effect", competence=("oracle_correct",)),
        # (identity: a KV edit never writes the weights)
        Claim("weight_edit_kv_weights_unchanged", "KV edits leave the weights unchanged (checksum)", "identity", "methods.field_erratum.weights_unchanged", role="control", competence=("oracle_correct",)),
        # (can fail: a rollback that leaves a residue changes the checksum)
        Claim("weight_edit_rome_rollback_exact", "rolling ROME back restores the weights byte for byte", "at_least", "methods.rome.rollback_exact", bound=1 - ACCURACY_MARGIN, role="control", competence=("oracle_correct",)),
      
        Claim("weight_edit_lora_rollback_exact", "unloading the LoRA adapter restores the weights byte for byte", "at_least", "methods.lora.rollback_exact", bound=1 - ACCURACY_MARGIN, role="control", competence=("oracle_correct",)),
    ))
