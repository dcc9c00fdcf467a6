"""Weight edit: KV editing vs weight editing for mutable per-request state (paper Table 1, Appendix I).

The target is one request of the gated task whose field changed (permitting -> blocking value, e.g.
order_status pending -> shipped, so the action goes cancel -> deny) while its stale cache or its stale context
is all the system holds. Each method must make that request decide the new action:

- KV edits over the request's own cache (:mod:`kvprobe.kv.edit`): in_place, erratum, field+erratum;
- ROME (:mod:`kvprobe.edits.rome`): the key ``k*`` is the mid-layer ``down_proj`` input at the subject's last
  token, ``v*`` optimised (with a KL term on an essence prompt ``"{subject} is a"``) so the stale context decides
  the new action, and the closed-form rank-one update written into the weights. Which token is the subject is
  a design choice that sets the contamination, so every row states it (``methods.<rome>.subject``):
  ``rome`` is keyed on the field's **value** (its last token, e.g. " pending"), which rewrites "value -> new
  action" for every prompt of the field; ``rome_entity`` (``params.rome_subjects``) is keyed on the request's
  **entity**, the order/record id (its last occurrence in the prompt, its last token), ROME's natural subject;
- LoRA (:mod:`kvprobe.edits.lora`): r = 8 on q, v and down, fine-tuned on the stale context with the new
  action as the label until the decision flips.

Four measures for every method, on the same target: efficacy (the target decides the new action);
cross-request contamination (the fraction of 8 held-out requests of the same field, genuinely still at the
old value so their correct answer is the un-edited one, that the same model instance now decides with the
new action; over the held-outs the un-edited model gets right); collateral damage (the fraction of a 10-item
battery of unrelated gated decisions, the template's other scenarios, whose decision changes against the
un-edited model); and edit latency, from the stale cache held to the decision logits (a weight edit must
also reprefill the request: the cache of the old weights is invalid), timed side by side in one run and
reported as ratios to the erratum. Plus the rollback (its cost, and whether the weights come back
byte-identical by checksum) and the two-request test (one instance serves the edited request and a held-out
old-value request: both right?). Contamination and collateral are decisions; each has its graded form beside it
(``heldout_ld_shift``: the held-outs' mean move toward the new action, ``collateral_ld_abs_shift``: the battery's
mean absolute move, in nats of LD(old - new)), which a weight edit moves even where no decision flips.

Targets and held-outs. ``params.scenarios`` draws the targets from several template scenarios in turn
(instance i from ``scenarios[i % len]``): each scenario is one cluster, and inference (the summary's CIs,
the claims' tests) is by scenario cluster, so a verdict needs targets from >= 5 scenarios
(``kvprobe.claims.MIN_CLUSTERS``). ``params.heldout_rule`` picks each target's held-outs: ``same_format``
(the records before it) takes the next draws of the one scenario in the target's format, near-copies of the
target prompt (token similarity ~0.9) shared by every target; ``varied`` takes, per target, requests of the
same field at the same old value with another entity id, rendered in the generator's other formats with
varied notes and wording, each kept only if its token similarity to the target and to every held-out kept
before it is at most ``heldout_max_similarity`` (:func:`kvprobe.tasks.heldout.pick_distinct`). Every row lists
its held-outs with their similarities and the record states the rule.

ROME's key covariance is one pass over a stated text sample: ``params.cov_tokens`` = 0 (the records before
it) uses the project's neutral passage and the template's filler rules (676 SmolLM2 tokens, fewer than the
1,536-dim key, so the ridge carries C); ``cov_tokens`` > 0 uses that many tokens of Python's bundled help
topics (``pydoc_data.topics`` of the standard library, the SAE's neutral English,
:func:`kvprobe.features.sae.neutral_sequences`), cached per model, layer and token ids in the kvprobe cache.

Identities, labelled as such: a KV edit leaves the weights unchanged (checked by checksum on every target),
so its contamination and collateral are 0 by construction: the other requests are served by the same,
unchanged weights with their own caches, and its rollback is dropping the edited cache.

Where our setting differs: small CPU models; the paper's battery of "unrelated single-token gated decisions"
is here the task's other scenarios in the same prompt shape; ROME uses the request prompt without sampled
context prefixes and a small ridge on the covariance. The paper does not say which token its ROME edit is
keyed on.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvprobe.backends import HookableModel
from kvprobe.claims import ACCURACY_MARGIN, MIN_CLUSTERS, Claim
from kvprobe.edits import lora, rome
from kvprobe.edits.weights import weights_checksum
from kvprobe.errors import KVProbeError
from kvprobe.kv import edit
from kvprobe.kv.readout import prefill
from kvprobe.paper import headlines as paper_headlines
from kvprobe.probes.edit_summary import base_row, edit_case, edit_gate_summary, read_ld
from kvprobe.probes.summary import ci_cell, scenarios
from kvprobe.runner.experiment import Context, Experiment
from kvprobe.schema import hash_neutral
from kvprobe.stats.bootstrap import summarize
from kvprobe.stats.inference import summarize_proportion
from kvprobe.tasks.edits import erratum_body, erratum_line, prompt_ids
from kvprobe.tasks.gated import build_instance, instance_prompt, load_template, tokenize_pair
from kvprobe.tasks.heldout import entity_of, entity_or_none, pick_distinct, token_similarity

KV_METHODS = ("in_place", "erratum", "field_erratum")
WEIGHT_METHODS = ("rome", "lora")
METHODS = (*KV_METHODS, *WEIGHT_METHODS)
ROME_METHOD = {"value": "rome", "entity": "rome_entity"}  # the method name of each ROME subject
METHOD_ORDER = (*KV_METHODS, "rome", "rome_entity", "lora")
NEUTRAL_TEXT = Path(__file__).resolve().parents[1] / "kvprobe" / "organism" / "data" / "neutral.txt"
COV_WINDOW = 256  # tokens per sequence of the help-topics covariance sample
COV_SOURCE = ("Python's bundled help topics (pydoc_data.topics, standard library; "
              "kvprobe.features.sae.neutral_sequences)")
COV_SOURCE_V1 = "kvprobe/organism/data/neutral.txt + the gated template's filler rules"
HELDOUT_NOTES = (0, 2, 4)  # note lines of the varied held-outs, in turn (one value per pass over the formats)
HELDOUT_DRAWS = 200  # candidates tried per target before the varied rule gives up
HELDOUT_BASE = 100_000  # held-out draw i of target t: index HELDOUT_BASE + 1000 t + i (apart from every target)
COLLATERAL_BASE = 10_000


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    scenario: str = Field("order_status", description="the template scenario of the target and held-out requests "
                                                       "(with scenarios null)")
    scenarios: list[str] | None = hash_neutral(
        None, description="target scenarios, taken in turn (instance i from scenarios[i % len]); each is one "
                          "cluster, and a verdict needs >= 5; null: params.scenario alone (one cluster)")
    n_heldout: int = Field(8, ge=1, description="held-out requests at the old value (contamination)")
    n_collateral: int = Field(10, ge=1, description="unrelated gated decisions, other scenarios (collateral)")
    heldout_rule: Literal["same_format", "varied"] = hash_neutral(
        "same_format", description="same_format: the next draws of the scenario in the target's format, shared by "
                                   "every target (near-copies); varied: per target, other formats/notes/wording, "
                                   "none more similar than heldout_max_similarity (see the module docstring)")
    heldout_max_similarity: float = hash_neutral(
        0.8, gt=0, le=1, description="varied: the highest token similarity (difflib ratio over token ids) a "
                                     "held-out may have to the target prompt or to an earlier held-out")
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
    rome_subjects: list[Literal["value", "entity"]] = hash_neutral(
        ["value"], description="the ROME edits run, by the token each is keyed on: value (method rome: the "
                               "field value's last token) and/or entity (method rome_entity: the request's id)")
    cov_tokens: int = hash_neutral(
        0, ge=0, description="ROME covariance sample: 0 = neutral.txt + the filler rules (676 SmolLM2 tokens); "
                             "n > 0 = n tokens of Python's bundled help topics, cached")
    lora_r: int = 8
    lora_lr: float = 1e-3
    lora_max_steps: int = 40
    lora_margin: float = Field(1.0, description="nats the new action must lead by for the LoRA edit to stop")

    @field_validator("scenarios", "rome_subjects")
    @classmethod
    def _distinct(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or len(set(v)) != len(v)):
            raise ValueError("give a non-empty list without repeats")
        return v


def _layer(ctx: Context) -> int:
    return ctx.params.rome_layer if ctx.params.rome_layer is not None else ctx.lm.spec.n_layers // 2


def _build(ctx: Context, scenario: Any, i: int, fmt: str | None = None, n_notes: int | None = None,
           surface: bool = False) -> Any:
    from kvprobe.tasks.generator import build_generated, template_family

    fmt = ctx.params.format if fmt is None else fmt
    if fmt is None:
        return build_instance(ctx.template, scenario, i, ctx.cfg.seed, ctx.cfg.task.n_filler)
    return build_generated(i, ctx.cfg.seed, ctx.params.split, fmt, tokenizer=ctx.lm.tokenizer,
                           chat=ctx.lm.has_chat_template, counterfactual=0.0, family=template_family(scenario),
                           n_notes=ctx.params.n_notes if n_notes is None else n_notes, surface=surface)


def target_scenarios(params: Params) -> list[str]:
    return list(params.scenarios) if params.scenarios else [params.scenario]


def make_instances(ctx: Context) -> list[Any]:
    """Targets (allow -> block changes), from the target scenarios in turn with one shared draw counter (so two
    targets never share a draw); with the same_format rule, then the held-out requests of the first scenario at
    the allow value (shared by every target). The collateral battery comes from the other scenarios. With one
    scenario this is the draw order of the records before ``scenarios`` existed."""
    ctx.template = load_template(ctx.cfg.task.template)
    names = target_scenarios(ctx.params)
    chosen = [ctx.template.scenario(n) for n in names]
    n, shared = ctx.cfg.task.n_instances, ctx.params.heldout_rule == "same_format"
    want = n + (ctx.params.n_heldout if shared else 0)
    pool, by_index, i = [], {}, 0
    while len(pool) < want and i < 50 * want:
        sc = chosen[len(pool) % len(chosen)] if len(pool) < n else chosen[0]
        inst = _build(ctx, sc, i)
        if inst.old_value == sc.allow_value:  # e.g. pending -> shipped: cancel -> deny
            pool.append(inst)
            by_index[inst.index] = sc
        i += 1
    if len(pool) < want:
        raise KVProbeError(f"only {len(pool)} allow -> block draws of {names} in {i} tries (wanted {want})")
    ctx.scratch["target_scenario"] = by_index
    if shared:
        main = chosen[0]
        ctx.scratch["heldout"] = pool[n:]
        ctx.scratch["collateral"] = _collateral(ctx, main)
    return pool[:n]


def _collateral(ctx: Context, scenario: Any) -> list[Any]:
    """The battery of unrelated decisions for a target of ``scenario``: the template's other scenarios in file
    order, one draw each (index 10000 + j), in the run's format."""
    others = [s for s in ctx.template.scenarios if s.name != scenario.name]
    return [_build(ctx, others[j % len(others)], COLLATERAL_BASE + j) for j in range(ctx.params.n_collateral)]


# -- held-outs ---------------------------------------------------------------------------------------------

def heldout_rule_text(params: Params) -> str:
    if params.heldout_rule == "same_format":
        return ("same_format: the first target scenario in the target format, the next draws whose field holds the "
                "old value (other entity ids), shared by every target; near-copies of the target prompt")
    return ("varied: per target, requests of the same field at the same old value (correct: the old action) with "
            "another entity id, rendered in the generator formats other than the target's in turn, with "
            f"{'/'.join(map(str, HELDOUT_NOTES))} note lines and re-drawn surface wording; a candidate is kept only "
            "if its token similarity (difflib ratio over token ids) to the target prompt and to every held-out kept "
            f"before it is <= {params.heldout_max_similarity}")


def _varied_heldouts(ctx: Context, inst: Any, target_ids: Sequence[int]) -> list[tuple[Any, Sequence[int], float]]:
    from kvprobe.tasks.generator import FORMATS

    p, lm = ctx.params, ctx.lm
    scenario = ctx.scratch["target_scenario"][inst.index]
    formats = [f for f in FORMATS if f != p.format]
    own = entity_of(inst)

    def candidates() -> Iterable[tuple[Any, Sequence[int]]]:
        for d in range(HELDOUT_DRAWS):
            fmt = formats[d % len(formats)]
            notes = HELDOUT_NOTES[(d // len(formats)) % len(HELDOUT_NOTES)]
            h = _build(ctx, scenario, HELDOUT_BASE + 1000 * inst.index + d, fmt=fmt, n_notes=notes, surface=True)
            if h.old_value != inst.old_value or h.field != inst.field or entity_of(h) == own:
                continue
            yield h, tokenize_pair(lm.tokenizer, h, lm.has_chat_template).ids_old

    kept = pick_distinct(target_ids, candidates(), p.n_heldout, p.heldout_max_similarity)
    if len(kept) < p.n_heldout:
        raise KVProbeError(f"the varied held-out rule found {len(kept)} of {p.n_heldout} held-outs for instance "
                           f"{inst.index} in {HELDOUT_DRAWS} draws; lower n_heldout or raise heldout_max_similarity")
    return kept


@dataclass
class Battery:
    """A target's held-out requests and collateral decisions, tokenized, with the un-edited model's decisions."""

    pairs: dict[str, list[Any]]
    baseline: dict[str, list[dict[str, Any]]]
    record: dict[str, Any]


def _battery(ctx: Context, inst: Any, pair: Any) -> Battery:
    lm, p = ctx.lm, ctx.params
    if p.heldout_rule == "same_format":
        held = [(h, tokenize_pair(lm.tokenizer, h, lm.has_chat_template).ids_old) for h in ctx.scratch["heldout"]]
        held = [(h, ids, token_similarity(pair.ids_old, ids)) for h, ids in held]
        collateral = ctx.scratch["collateral"]
    else:
        held = _varied_heldouts(ctx, inst, pair.ids_old)
        collateral = _collateral(ctx, ctx.scratch["target_scenario"][inst.index])
    pairs = {"heldout": [tokenize_pair(lm.tokenizer, h, lm.has_chat_template) for h, _, _ in held],
             "collateral": [tokenize_pair(lm.tokenizer, c, lm.has_chat_template) for c in collateral]}
    baseline = ctx.scratch["baseline"] if p.heldout_rule == "same_format" else _decide(lm, pairs)
    items = []
    for j, (h, ids, sim) in enumerate(held):
        others = [token_similarity(ids, o) for k, (_, o, _) in enumerate(held) if k != j]
        items.append({"index": h.index, "format": h.meta.get("format", p.format), "n_notes": h.meta.get("n_notes"),
                      "entity": entity_or_none(h), "n_tokens": len(ids), "similarity_to_target": round(sim, 4),
                      "max_similarity_to_other_heldouts": round(max(others), 4) if others else None,
                      "unedited_old_action": baseline["heldout"][j]["old_action"]})
    unedited = {k: {"n": len(v), "old_action": sum(d["old_action"] for d in v)} for k, v in baseline.items()}
    record = {"heldout": items, "collateral_scenarios": [c.field for c in collateral], "unedited": unedited}
    return Battery(pairs, baseline, record)


def _decision(lm: HookableModel, pair: Any) -> dict[str, Any]:
    """The request at its old value: logit difference (old action minus new action) and its decision."""
    _, logits = prefill(lm, pair.ids_old, return_logits=True)
    ld = float(logits[0, pair.old_action_id] - logits[0, pair.new_action_id])
    return {"ld_old_minus_new": ld, "old_action": ld > 0}


def _decide(lm: HookableModel, pairs: dict[str, list[Any]]) -> dict[str, list[dict[str, Any]]]:
    return {name: [_decision(lm, pr) for pr in pairs[name]] for name in ("heldout", "collateral")}


# -- ROME subjects -------------------------------------------------------------------------------------------

def rome_subject(tokenizer: Any, inst: Any, pair: Any, chat: bool, kind: str) -> tuple[rome.SubjectPrompt, dict]:
    """The prompt ROME edits for a target and the statement of its subject: ``value`` keys on the field value's
    last token; ``entity`` on the last token of the entity id's last occurrence in the prompt."""
    if kind == "value":
        pos, text, where = pair.field_slots[-1], inst.old_value, "the field's value"
    elif kind == "entity":
        text, where = entity_of(inst), "last occurrence"
        prompt, special = instance_prompt(tokenizer, inst, inst.old_value, chat)
        placed = rome.subject_prompt(tokenizer, prompt, text, special)
        if list(placed.ids) != list(pair.ids_old):
            raise KVProbeError(f"instance {inst.index}: its prompt re-tokenizes differently; cannot place the entity")
        pos = placed.subject_pos
    else:
        raise KVProbeError(f"unknown ROME subject {kind!r} (value or entity)")
    statement = {"kind": kind, "text": text, "where": where, "position": int(pos),
                 "token": tokenizer.decode([pair.ids_old[pos]])}
    return rome.SubjectPrompt(tuple(pair.ids_old), int(pos)), statement


def _essence(tokenizer: Any, inst: Any, kind: str, text: str) -> rome.SubjectPrompt:
    if kind == "value":
        return rome.subject_prompt(tokenizer, f"{inst.field}: {inst.old_value} is a", inst.old_value)
    return rome.subject_prompt(tokenizer, f"{text} is a", text)


# -- covariance ----------------------------------------------------------------------------------------------

def covariance_sample(ctx: Context) -> tuple[list[list[int]], str]:
    """ROME's stated key-covariance sample and its name: params.cov_tokens tokens of Python's help topics
    (``COV_WINDOW``-token windows), or with 0 the project's neutral passage and the gated template's filler rules
    (policy boilerplate unrelated to any field)."""
    tok = ctx.lm.tokenizer
    if ctx.params.cov_tokens:
        from kvprobe.features.sae import neutral_sequences

        return neutral_sequences(tok, ctx.params.cov_tokens, COV_WINDOW), COV_SOURCE
    texts = [NEUTRAL_TEXT.read_text(), "\n".join(ctx.template.filler_rules)]
    return [tok(t)["input_ids"] for t in texts], COV_SOURCE_V1


def setup(ctx: Context) -> None:
    if ctx.params.heldout_rule == "same_format":
        pairs = {name: [tokenize_pair(ctx.lm.tokenizer, h, ctx.lm.has_chat_template) for h in ctx.scratch[name]]
                 for name in ("heldout", "collateral")}
        ctx.scratch["baseline"] = _decide(ctx.lm, pairs)
    ctx.scratch["checksum"] = weights_checksum(ctx.lm)
    seqs, source = covariance_sample(ctx)
    if ctx.params.cov_tokens:
        cov, cached = rome.cached_key_covariance(ctx.lm, _layer(ctx), seqs)
    else:  # the records before cov_tokens: one pass, no cache
        cov, cached = rome.key_covariance(ctx.lm, _layer(ctx), seqs), None
    ctx.scratch["cov"] = cov
    ctx.scratch["cov_info"] = {"layer": cov.layer, "tokens": cov.n_tokens, "seconds": cov.seconds, "text": source}
    if cached is not None:
        ctx.scratch["cov_info"].update(cached=cached, window=COV_WINDOW)


def _spread(baseline: dict[str, list[dict[str, Any]]], after: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Contamination (of the held-outs the un-edited model gets right, the fraction that now decide the new action)
    and collateral (the fraction of the battery whose decision changes), each with its graded form: the held-outs'
    mean move toward the new action and the battery's mean absolute move, in nats of LD(old - new)."""
    held = [b["old_action"] and not a["old_action"] for b, a in zip(baseline["heldout"], after["heldout"])]
    right = [b["old_action"] for b in baseline["heldout"]]
    changed = [b["old_action"] != a["old_action"] for b, a in zip(baseline["collateral"], after["collateral"])]
    toward_new = [b["ld_old_minus_new"] - a["ld_old_minus_new"] for b, a in zip(baseline["heldout"], after["heldout"])]
    moved = [abs(b["ld_old_minus_new"] - a["ld_old_minus_new"])
             for b, a in zip(baseline["collateral"], after["collateral"])]
    return {"contamination": sum(held) / max(1, sum(right)),
            "collateral": sum(changed) / len(changed),
            "heldout_ld_shift": statistics.fmean(toward_new), "collateral_ld_abs_shift": statistics.fmean(moved),
            "heldout_first_correct": after["heldout"][0]["old_action"]}


def run_instance(ctx: Context, inst: Any) -> dict[str, Any]:
    lm, p = ctx.lm, ctx.params
    c = edit_case(ctx, inst, 1)
    pair, e = c.pair, c.edit
    bat = _battery(ctx, inst, pair)
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
        methods[name].update(weights_unchanged=unchanged, contamination=0.0, collateral=0.0, heldout_ld_shift=0.0,
                             collateral_ld_abs_shift=0.0, rollback_exact=unchanged,
                             heldout_first_correct=bat.baseline["heldout"][0]["old_action"],
                             identity=True)

    def weight_method(name: str, apply_edit: Any, **extra: Any) -> None:
        t0 = time.perf_counter()
        handle = apply_edit()
        edit_s = time.perf_counter() - t0
        ld = read_ld(lm, pair, prefill(lm, pair.ids_old[:-1]), pair.ids_old[-1:])  # reprefill: old cache is stale
        latency = time.perf_counter() - t0
        spread = _spread(bat.baseline, _decide(lm, bat.pairs))
        t1 = time.perf_counter()
        handle.rollback(lm) if isinstance(handle, rome.RomeEdit) else handle.rollback()
        rollback_s = time.perf_counter() - t1
        methods[name] = {"ld": ld, "efficacy": ld > 0, "latency_s": latency, "edit_s": edit_s,
                         "rollback_s": rollback_s, "rollback_exact": weights_checksum(lm) == ctx.scratch["checksum"],
                         "weights_unchanged": False, "identity": False, **spread, **extra, "detail": handle.detail}

    layer = _layer(ctx)
    for kind in p.rome_subjects:
        target, subject = rome_subject(lm.tokenizer, inst, pair, lm.has_chat_template, kind)
        essence = _essence(lm.tokenizer, inst, kind, subject["text"])
        weight_method(ROME_METHOD[kind], lambda target=target, essence=essence: rome.rome_edit(
            lm, layer, [target], [pair.new_action_id], ctx.scratch["cov"], [essence], ridge=p.rome_ridge,
            steps=p.rome_steps, lr=p.rome_lr, kl_weight=p.rome_kl_weight), subject=subject)
    weight_method("lora", lambda: lora.lora_edit(lm, [pair.ids_old], pair.new_action_id, pair.old_action_id, r=p.lora_r,
                                                 lr=p.lora_lr, max_steps=p.lora_max_steps, margin=p.lora_margin,
                                                 seed=ctx.cfg.seed + inst.index))
    for name in methods:
        methods[name]["two_requests_correct"] = bool(methods[name]["efficacy"]
                                                     and methods[name]["heldout_first_correct"])
    methods = {name: methods[name] for name in METHOD_ORDER if name in methods}
    return {**base_row(ctx, inst, c), "target_scenario": ctx.scratch["target_scenario"][inst.index].name,
            "erratum_text": line, "rome_layer": layer, "methods": methods, **bat.record}


def summarize_rows(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = edit_gate_summary(ctx, rows)
    use = [r for r in rows if r["included"]] or rows
    clusters = scenarios(use)
    ref = [r["methods"]["erratum"]["latency_s"] for r in use]
    out["methods"] = {}
    for name in [m for m in METHOD_ORDER if use and m in use[0]["methods"]]:
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
        if "heldout_ld_shift" in use[0]["methods"][name]:  # the graded forms (rows before them have none)
            for k in ("heldout_ld_shift", "collateral_ld_abs_shift"):
                out["methods"][name][k] = summarize(col(k), seed=ctx.cfg.seed, clusters=clusters)
        if "subject" in use[0]["methods"][name]:
            out["methods"][name]["subject"] = use[0]["methods"][name]["subject"]["kind"]
    out["covariance"] = ctx.scratch.get("cov_info")
    p = ctx.params
    if p.heldout_rule == "same_format":
        base = ctx.scratch.get("baseline", {})
        out["unedited"] = {k: {"n": len(v), "old_action": sum(d["old_action"] for d in v)} for k, v in base.items()}
    else:  # each target has its own battery: summed over the summarized rows
        out["unedited"] = {k: {"n": sum(r["unedited"][k]["n"] for r in use),
                               "old_action": sum(r["unedited"][k]["old_action"] for r in use)}
                           for k in ("heldout", "collateral")}
    if p.scenarios is not None or p.heldout_rule != "same_format" or p.rome_subjects != ["value"]:
        sims = [h["similarity_to_target"] for r in use for h in r.get("heldout", [])]
        pair_sims = [h["max_similarity_to_other_heldouts"] for r in use for h in r.get("heldout", [])
                     if h["max_similarity_to_other_heldouts"] is not None]
        out["design"] = {
            "target_scenarios": list(dict.fromkeys(r["target_scenario"] for r in rows)),
            "n_target_clusters": len(set(scenarios(rows))),  # every target; the columns are over n_clusters
            "n_clusters": len(set(clusters)), "verdict_possible": len(set(clusters)) >= MIN_CLUSTERS,
            "heldout_rule": heldout_rule_text(p),
            "heldout_similarity_to_target_max": max(sims) if sims else None,
            "heldout_similarity_pairwise_max": max(pair_sims) if pair_sims else None,
            "rome_subjects": {ROME_METHOD[k]: k for k in p.rome_subjects},
        }
    return out


def _cells(m: dict[str, Any]) -> tuple[str, str, str, bool]:
    """Efficacy, contamination and collateral cells, each a mean with its interval or a mean marked ``*`` where
    there is none (too few scenario clusters), and whether any is so marked."""
    cells = [ci_cell(m[k]) for k in ("efficacy", "contamination", "collateral")]
    marked = [c.split(" (", 1)[0] + ("*" if " (" in c else "") for c in cells]
    return marked[0], marked[1], marked[2], any(" (" in c for c in cells)


def table(s: dict[str, Any]) -> str:
    lines = [f"instances {s['n_instances']}, included {s['n_included']} (columns over {s['summary_over']}); "
             f"un-edited model: held-out old action {s['unedited']['heldout']['old_action']}/"
             f"{s['unedited']['heldout']['n']}; ROME covariance {s['covariance']['tokens']} tokens, "
             f"{s['covariance']['seconds']:.2f} s, layer {s['covariance']['layer']}",
             f"{'method':<15}{'efficacy':<22}{'contamination':<24}{'collateral':<24}{'x erratum':>10}"
             f"{'rollback s':>11}  exact"]
    design = s.get("design")
    if design:
        lines.insert(1, f"targets from {design['n_target_clusters']} scenario clusters, the columns over "
                        f"{design['n_clusters']} (a verdict needs >= {MIN_CLUSTERS}); "
                        f"held-outs: {design['heldout_rule'].split(':', 1)[0]}, max token similarity to the target "
                        f"{design['heldout_similarity_to_target_max']}; ROME keyed on "
                        + ", ".join(f"{k} ({m})" for m, k in design["rome_subjects"].items())
                        + f"; covariance: {s['covariance']['text']}")
    no_interval = False
    for name, m in s["methods"].items():
        tag = " (identity)" if m["identity"] else ""
        if design:
            eff, cont, coll, flag = _cells(m)
        else:  # the rendering of the records before the design block
            cells = [ci_cell(m[k]) for k in ("contamination", "collateral")]
            flag = any("(no CI" in c for c in cells)
            cont, coll = (c.split(" (no CI", 1)[0] + ("*" if "(no CI" in c else "") for c in cells)
            eff = ci_cell(m["efficacy"])
        no_interval |= flag
        lines.append(f"{name:<15}{eff:<22}{cont + tag:<24}"
                     f"{coll + tag:<24}{m['latency_x_erratum_median']:>10.2f}"
                     f"{m['rollback_s_median']:>11.4f}  {m['rollback_exact']}")
    graded = [n for n, m in s["methods"].items() if "heldout_ld_shift" in m and not m["identity"]]
    if graded:
        lines.append("graded, nats of LD(old - new): held-out move toward the new action / battery |move|: "
                     + ", ".join(f"{n} {s['methods'][n]['heldout_ld_shift']['mean']:+.2f} / "
                                 f"{s['methods'][n]['collateral_ld_abs_shift']['mean']:.2f}" for n in graded))
    if no_interval:
        lines.append(f"* no interval: the targets come from fewer than {MIN_CLUSTERS} scenario clusters"
                     if design else "* no interval: every target is the same scenario (one cluster)")
    return "\n".join(lines)


def headline(s: dict[str, Any]) -> str:
    m = s["methods"]
    names = [n for n in ("field_erratum", "in_place", "rome", "rome_entity", "lora") if n in m]
    label = {"rome": "rome (value-keyed)", "rome_entity": "rome (entity-keyed)"} if "design" in s else {}
    text = "; ".join(f"{label.get(n, n)} flips {m[n]['efficacy']['mean']:.2f}, "
                     f"contam {m[n]['contamination']['mean']:.2f}, "
                     f"collat {m[n]['collateral']['mean']:.2f}, {m[n]['latency_x_erratum_median']:.1f}x erratum"
                     for n in names) + " (KV contam/collat: identity)"
    if "design" in s:
        text += f"; {s['design']['n_clusters']} scenario clusters"
    return text


EXPERIMENT = Experiment(
    section="sec9",
    name="weight_edit", doc=__doc__, params=Params, run_instance=run_instance, summarize=summarize_rows,
    make_instances=make_instances, setup=setup, table=table, headline=headline,
    paper=paper_headlines("weight_edit"),
    # Every claim is tested on scenario clusters: from fewer than kvprobe.claims.MIN_CLUSTERS (5) target scenarios
    # it is "not measurable" (the records before params.scenarios have one). "rome" is keyed on the field's value
    # token, "rome_entity" on the request's entity id; the paper does not say which token its ROME is keyed on.
    claims=(
      
        Claim("weight_edit_field_erratum_flips", "field+erratum flips the target decision",
              "at_least", "methods.field_erratum.efficacy", bound=0.5, role="effect", competence=("oracle_correct",)),
      
        Claim("weight_edit_rome_flips", "ROME (keyed on the field's value token) flips the target decision", "at_least",
              "methods.rome.efficacy", bound=0.5, role="effect", competence=("oracle_correct",)),
      
        Claim("weight_edit_rome_entity_flips", "ROME keyed on the request's entity id flips the target decision",
              "at_least", "methods.rome_entity.efficacy", bound=0.5, role="effect", competence=("oracle_correct",)),
      
        Claim("weight_edit_lora_flips", "LoRA flips the target decision", "at_least",
              "methods.lora.efficacy", bound=0.5, role="effect", competence=("oracle_correct",)),
      
        Claim("weight_edit_rome_contaminates", "ROME (keyed on the field's value token) contaminates held-out requests more than field+erratum", "greater", "methods.rome.contamination", "methods.field_erratum.contamination", role="effect", competence=("oracle_correct",)),
      
        Claim("weight_edit_rome_entity_contaminates", "ROME keyed on the request's entity id contaminates held-out requests more than field+erratum", "greater", "methods.rome_entity.contamination", "methods.field_erratum.contamination", role="effect", competence=("oracle_correct",)),
      
        Claim("weight_edit_lora_contaminates", "LoRA contaminates held-out requests more than field+erratum", "greater", "methods.lora.contamination", "methods.field_erratum.contamination", role="effect", competence=("oracle_correct",)),
      
        Claim("weight_edit_rome_collateral", "ROME (keyed on the field's value token) changes unrelated decisions more than field+erratum", "greater", "methods.rome.collateral", "methods.field_erratum.collateral", role="effect", competence=("oracle_correct",)),
      
        Claim("weight_edit_rome_slower", "a ROME edit takes longer than the erratum (side by side, one run)", "greater", "methods.rome.latency_s", "methods.erratum.latency_s", role="effect", competence=("oracle_correct",)),
        # (identity: a KV edit never writes the weights)
        Claim("weight_edit_kv_weights_unchanged", "KV edits leave the weights unchanged (checksum)", "identity", "methods.field_erratum.weights_unchanged", role="control", competence=("oracle_correct",)),
        # (can fail: a rollback that leaves a residue changes the checksum)
        Claim("weight_edit_rome_rollback_exact", "rolling ROME back restores the weights byte for byte", "at_least", "methods.rome.rollback_exact", bound=1 - ACCURACY_MARGIN, role="control", competence=("oracle_correct",)),
      
        Claim("weight_edit_lora_rollback_exact", "unloading the LoRA adapter restores the weights byte for byte", "at_least", "methods.lora.rollback_exact", bound=1 - ACCURACY_MARGIN, role="control", competence=("oracle_correct",)),
    ))
