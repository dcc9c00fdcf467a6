"""Competence screen: does full recompute decide each application task above chance (paper App. H's inclusion
gate: a model enters the memory tests only where its full-recompute, oracle, accuracy is >= 0.80; Sec. 7: direct
memory decisions are at chance for <= 8B models, a chain of thought is the competent regime).

Per application task (``tasks``: memory, tau2, twohop_blocks, agent, locomo, edit_in_transplant), the task's
own experiment builds ``task.n_instances`` instances (its ``make_instances``, or the gated template's instances
for agent and edit_in_transplant) and each instance is read twice under full recompute, once with the field's
OLD value and once with its NEW value, whose correct actions differ:

- memory: the persona memory, and the same memory with its toggle setting flipped (E3's toggle);
- tau2: the order record with status ``pending`` (cancel) and ``processed`` (deny);
- twohop_blocks: the two-hop memory, and the same with the governing setting's value B flipped;
- agent: turn 1 (an erratum sets the new value) and turn 2 (a second erratum restores the old), the agent's
  own turn prompts;
- edit_in_transplant: the gated prompt with the old and the new value in the field (its stale and oracle);
- locomo (free-form answers): the question, and a partner question of the same conversation whose evidence
  is in the same memory and whose gold answer differs; both are read as a two-choice between the two gold
  answers, scored by teacher-forced log-probability (the field is the question).

Each read is the two-action decision over the full-recompute cache (:mod:`kvprobe.probes.decision`) in each
mode: direct (the argmax of the two action tokens after the answer prefix) and after a bounded greedy chain
(``chain_tokens``; the last action the chain names, else the forced read after the answer cue). Because every
instance contributes one decision per value and the two values' correct actions differ, a model that gives
one answer whatever the field says scores exactly 0.5: chance is 0.5.

Per task x mode the record gives the full-recompute accuracy over the 2n decisions with its exact
(Clopper-Pearson) interval, the count of each action decided, how many instances' decisions follow the field
(differ between the two values; ``varies``: at least one does; the gated template's action words differ by
scenario, so counts of words alone could show variety where every instance answers one way), and the field's effect on the two-action logit difference, LD(new) -
LD(old) with LD oriented towards the new value's action (nats; cluster-bootstrap CI by scenario). The verdict
``competent``: the interval's lower bound above chance AND accuracy >= ``gate`` (kvprobe's gate, App. H's 0.80 by
default); no verdict (null) from fewer than ``min_instances`` instances or ``min_clusters`` scenario clusters.
:func:`kvprobe.competence.competence` reads the verdict back for the claims.

Where our setting differs: small CPU models; the chain is induced by a cue and short; full recompute reuses
the previous prompt's cache for a shared token prefix (causally the same computation as a fresh prefill).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvprobe.errors import KVProbeError
from kvprobe.experiments import agent, edit_in_transplant, locomo, memory, tau2, twohop_blocks
from kvprobe.probes.decision import MODES, ChainSpec, DecisionRead, PrefixReuse, TwoChoice, read_decision
from kvprobe.probes.summary import ci_cell
from kvprobe.runner.config import validate_params
from kvprobe.runner.experiment import Context, Experiment, default_instances
from kvprobe.stats.bootstrap import summarize
from kvprobe.stats.inference import summarize_proportion
from kvprobe.tasks.edits import answer_prefix_tokens
from kvprobe.tasks.gated import tokenize_pair
from kvprobe.tasks.locomo import normalize_answer
from kvprobe.tasks.memory import ANSWER_PREFIX, VALUES, action_ids, render_ids, toggle_twohop
from kvprobe.paper import headlines as paper_headlines
from kvprobe.schema import distinct_subset
from kvprobe.competence import COMPETENCE_GATE, is_competent

TASKS = ("memory", "tau2", "twohop_blocks", "agent", "locomo", "edit_in_transplant")
EXPERIMENTS = {"memory": memory, "tau2": tau2, "twohop_blocks": twohop_blocks, "agent": agent, "locomo": locomo,
               "edit_in_transplant": edit_in_transplant}
CHANCE = 0.5  # one decision per field value, the two values' correct actions differ: a constant answer scores 0.5
LOCOMO_ANSWER_CUE = "\nShort answer:\n"


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    tasks: list[str] = Field(default_factory=lambda: list(TASKS), description="application tasks screened")
    modes: list[str] = Field(default_factory=lambda: list(MODES), description="direct and/or chain")
    chain_tokens: int = Field(48, ge=1, le=512, description="greedy chain budget (tokens)")
    cot_cue: str = Field("Let me think step by step.", description="run over the cache before the chain")
    gate: float = Field(COMPETENCE_GATE, gt=0.5, le=1.0, description="kvprobe's competence gate (App. H's oracle 0.80): "
                                                         "full-recompute accuracy must reach it")
    min_instances: int = Field(10, ge=1, description="fewer instances: no verdict")
    min_clusters: int = Field(5, ge=1, description="fewer scenario clusters: no verdict")
    locomo_max_answer_tokens: int = Field(16, ge=1, description="LoCoMo: gold answers longer than this are not "
                                                                "candidates (teacher forcing costs a forward a token)")
    task_params: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per task, its experiment's params (validated by it; defaults otherwise)")

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, v: list[str]) -> list[str]:
        return distinct_subset(v, TASKS, "tasks")

    @field_validator("modes")
    @classmethod
    def _modes(cls, v: list[str]) -> list[str]:
        return distinct_subset(v, MODES, "modes")

    @field_validator("task_params")
    @classmethod
    def _task_params(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        bad = sorted(set(v) - set(TASKS))
        if bad:
            raise ValueError(f"task_params names unknown tasks {bad}; choose from {list(TASKS)}")
        return v


@dataclass(frozen=True)
class ScreenInstance:
    """One application instance as two full-recompute reads: ``old`` and ``new`` field value (candidates
    oriented new value's action first, so LD > 0 leans to the new value's action)."""

    index: int
    task: str
    scenario: str
    source_index: int
    old: TwoChoice
    new: TwoChoice
    answer_cue: tuple[int, ...]
    labels: tuple[str, str]  # how decisions are counted: candidate 0's and candidate 1's label
    lead: tuple[int, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class ReadRow:
    decision: str  # the label of the candidate chosen
    correct: bool
    ld: float  # candidate 0 (the new value's action) minus candidate 1, nats
    decided_by: str
    chain_tokens: int
    chain_text: str


@dataclass(frozen=True)
class ScreenRow:
    task: str
    scenario: str
    source_index: int
    context_tokens: int  # both reads' contexts
    prefilled_tokens: int  # of which run through the model (the rest reused from a shared prefix)
    reads: dict[str, dict[str, ReadRow]]  # mode -> {"old", "new"}
    field_effect: dict[str, float]  # mode -> LD(new) - LD(old)
    follows_field: dict[str, bool]  # mode -> the decision differs between old and new
    meta: dict[str, Any]


def _sub_context(ctx: Context, task: str, n: int | None = None) -> Context:
    """A context for ``task``'s own experiment: its params (validated by it), the screen's task settings."""
    exp = EXPERIMENTS[task].EXPERIMENT
    params = validate_params(exp.params, ctx.params.task_params.get(task, {}), f"screen params.task_params.{task}")
    task_cfg = ctx.cfg.task.model_copy(update={"n_instances": n or ctx.cfg.task.n_instances})
    cfg = ctx.cfg.model_copy(update={"experiment": task, "task": task_cfg})
    return Context(cfg=cfg, params=params, lm=ctx.lm)


def _ids(tok: Any, text: str) -> tuple[int, ...]:
    return tuple(tok(text, add_special_tokens=False)["input_ids"])


def _action_choice(ids: list[int], r: int, tokens: tuple[int, int], actions: tuple[str, str],
                   correct: int) -> TwoChoice:
    return TwoChoice(tuple(ids[:-r]), tuple(ids[-r:]), ((tokens[0],), (tokens[1],)), actions, correct)


def _memory_like(sub: Context, old: Any, new: Any) -> tuple[TwoChoice, TwoChoice]:
    """Persona or two-hop memory prompts: the cache ends where ``Decision:`` begins."""
    tok, chat = sub.lm.tokenizer, sub.lm.has_chat_template
    acts = (new.action, old.action)
    out = []
    for x, correct in ((old, 1), (new, 0)):
        ids, _, prompt, special = render_ids(tok, x, chat)
        tokens = action_ids(tok, prompt, ids, special, acts)
        out.append(_action_choice(ids, memory.answer_tokens(sub, x, ids), (tokens[0], tokens[1]), acts, correct))
    return out[0], out[1]


def _gated(sub: Context, inst: Any, ids_old: list[int], ids_new: list[int]) -> tuple[TwoChoice, TwoChoice]:
    """A gated instance's old- and new-value prompts (through the answer prefix) as two reads."""
    tok, chat = sub.lm.tokenizer, sub.lm.has_chat_template
    pair = tokenize_pair(tok, inst, chat)
    r = answer_prefix_tokens(tok, inst, chat)
    acts, tokens = (inst.new_action, inst.old_action), (pair.new_action_id, pair.old_action_id)
    return _action_choice(ids_old, r, tokens, acts, 1), _action_choice(ids_new, r, tokens, acts, 0)


def _memory_instances(ctx: Context) -> list[tuple[str, int, TwoChoice, TwoChoice, dict[str, Any]]]:
    sub = _sub_context(ctx, "memory")
    out = []
    for inst in memory.make_instances(sub):
        new = inst.with_value(inst.toggle, VALUES[1 - VALUES.index(inst.value_of(inst.toggle))])
        old_tc, new_tc = _memory_like(sub, inst, new)
        out.append((inst.scenario, inst.index, old_tc, new_tc, {"layout": inst.meta["layout"], "toggle": inst.toggle}))
    return out


def _twohop_instances(ctx: Context) -> list[tuple[str, int, TwoChoice, TwoChoice, dict[str, Any]]]:
    sub = _sub_context(ctx, "twohop_blocks")
    out = []
    for inst in twohop_blocks.make_instances(sub):
        old_tc, new_tc = _memory_like(sub, inst, toggle_twohop(inst))
        out.append((inst.scenario, inst.index, old_tc, new_tc, {"old_value": inst.meta["value"]}))
    return out


def _pair_instances(ctx: Context, task: str) -> list[tuple[str, int, TwoChoice, TwoChoice, dict[str, Any]]]:
    """tau2 and edit_in_transplant: the field's old and new value in the same prompt."""
    sub = _sub_context(ctx, task)
    insts = tau2.make_instances(sub) if task == "tau2" else default_instances(sub)
    out = []
    for inst in insts:
        pair = tokenize_pair(sub.lm.tokenizer, inst, sub.lm.has_chat_template)
        old_tc, new_tc = _gated(sub, inst, pair.ids_old, pair.ids_new)
        out.append((inst.scenario, inst.index, old_tc, new_tc, {"old_value": inst.old_value,
                                                                "new_value": inst.new_value}))
    return out


def _agent_instances(ctx: Context) -> list[tuple[str, int, TwoChoice, TwoChoice, dict[str, Any]]]:
    """The agent's turns 1 (erratum: new value) and 2 (a second erratum: the old value again)."""
    sub = _sub_context(ctx, "agent")
    out = []
    for inst in default_instances(sub):
        (ids1, v1), (ids2, v2) = agent.turn_prompts(sub, inst, 2)
        if (v1, v2) != (inst.new_value, inst.old_value):
            raise KVProbeError(f"agent instance {inst.index}: turns 1 and 2 hold {v1!r}, {v2!r}, not new then old")
        old_tc, new_tc = _gated(sub, inst, ids2, ids1)
        out.append((inst.scenario, inst.index, old_tc, new_tc, {"old_turn": 2, "new_turn": 1}))
    return out


def _locomo_instances(ctx: Context, max_answer: int) -> list[tuple[str, int, TwoChoice, TwoChoice, dict[str, Any]]]:
    """LoCoMo's stratified questions, each with a partner question (same conversation, evidence inside the same
    memory, a different gold answer; the same category where one exists) read as a two-choice between the two
    gold answers. Drawn from twice the wanted number, then taken round-robin over the conversations."""
    n = ctx.cfg.task.n_instances
    sub = _sub_context(ctx, "locomo", 2 * n)
    tok = sub.lm.tokenizer
    convs = locomo.conversations(sub)
    by_conv: dict[str, list[tuple[str, int, TwoChoice, TwoChoice, dict[str, Any]]]] = {}
    for inst in locomo.make_instances(sub):
        conv = convs[inst.scenario]
        qa = conv.qa[inst.qa_index]
        gold = _ids(tok, str(qa.answer))
        if not 1 <= len(gold) <= max_answer:
            continue
        mem = set(inst.memory)
        pool = [j for j, q in enumerate(conv.qa) if j != inst.qa_index and q.answerable and q.evidence_sessions
                and set(q.evidence_sessions) <= mem and normalize_answer(str(q.answer)) != normalize_answer(str(qa.answer))
                and 1 <= len(_ids(tok, str(q.answer))) <= max_answer and _ids(tok, str(q.answer)) != gold]
        if not pool:
            continue
        # the same category first, then the closest answer length (a summed log-probability favours short
        # answers; the pair design keeps chance at 0.5 either way, the length match keeps the read sensitive)
        key = {j: (conv.qa[j].category != qa.category, abs(len(_ids(tok, str(conv.qa[j].answer))) - len(gold)))
               for j in pool}
        best = min(key.values())
        j = random.Random(f"{ctx.cfg.seed}:{inst.scenario}:{inst.qa_index}:partner").choice(
            [j for j in pool if key[j] == best])
        partner = conv.qa[j]
        acts = (str(qa.answer), str(partner.answer))
        cands = (gold, _ids(tok, str(partner.answer)))
        reads = []
        for question, correct in ((partner, 1), (qa, 0)):
            ids, _, _ = locomo.question_prompt(sub, inst.scenario, inst.memory, question.render())
            reads.append(TwoChoice(tuple(ids[:-1]), tuple(ids[-1:]), cands, acts, correct))
        by_conv.setdefault(inst.scenario, []).append(
            (inst.scenario, inst.qa_index, reads[0], reads[1],
             {"qa_index": inst.qa_index, "partner_qa_index": j, "category": qa.category,
              "partner_category": partner.category, "memory_sessions": list(inst.memory)}))
    out: list[tuple[str, int, TwoChoice, TwoChoice, dict[str, Any]]] = []
    queues = [list(v) for _, v in sorted(by_conv.items())]
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    return out


def make_instances(ctx: Context) -> list[ScreenInstance]:
    p, tok = ctx.params, ctx.lm.tokenizer
    out: list[ScreenInstance] = []
    for task in p.tasks:
        if task == "memory":
            built, cue = _memory_instances(ctx), "\n" + ANSWER_PREFIX
        elif task == "twohop_blocks":
            built, cue = _twohop_instances(ctx), "\n" + ANSWER_PREFIX
        elif task in ("tau2", "edit_in_transplant"):
            built, cue = _pair_instances(ctx, task), "\nDecision:"
        elif task == "agent":
            built, cue = _agent_instances(ctx), "\nDecision:"
        else:
            built, cue = _locomo_instances(ctx, p.locomo_max_answer_tokens), LOCOMO_ANSWER_CUE
        for scenario, source, old, new, meta in built:
            labels = ("question's gold", "partner's gold") if task == "locomo" else new.actions
            lead = new.answer_prefix if task == "locomo" else ()
            out.append(ScreenInstance(len(out), task, scenario, source, old, new, _ids(tok, cue), labels, lead, meta))
    return out


def run_instance(ctx: Context, inst: ScreenInstance) -> dict[str, Any]:
    lm, p = ctx.lm, ctx.params
    reuse = ctx.scratch.setdefault("reuse", PrefixReuse(lm))
    before = reuse.prefilled
    chain = ChainSpec(_ids(lm.tokenizer, p.cot_cue), inst.answer_cue, p.chain_tokens, inst.lead)
    reads: dict[str, dict[str, ReadRow]] = {m: {} for m in p.modes}
    for side, tc in (("old", inst.old), ("new", inst.new)):
        state = reuse.state(tc.context)
        for mode in p.modes:
            d: DecisionRead = read_decision(lm, state, tc, mode, chain)
            reads[mode][side] = ReadRow(inst.labels[d.choice], d.correct(tc), d.ld, d.decided_by, d.chain_tokens,
                                        d.chain_text)
    row = ScreenRow(inst.task, inst.scenario, inst.source_index, len(inst.old.context) + len(inst.new.context),
                    reuse.prefilled - before, reads,
                    {m: r["new"].ld - r["old"].ld for m, r in reads.items()},
                    {m: r["new"].decision != r["old"].decision for m, r in reads.items()}, inst.meta)
    return asdict(row)


def cell(rows: list[dict[str, Any]], mode: str, p: Params, seed: int = 0) -> dict[str, Any]:
    """One task x mode: accuracy (exact CI), action counts, field effect, verdict."""
    sides = [(r, r["reads"][mode][s]) for r in rows for s in ("old", "new")]
    clusters = [r["scenario"] for r, _ in sides]
    acc = summarize_proportion([x["correct"] for _, x in sides], clusters)
    counts = dict(Counter(x["decision"] for _, x in sides))
    n, n_clusters = len(rows), len({r["scenario"] for r in rows})
    follows = sum(bool(r["follows_field"][mode]) for r in rows)
    out: dict[str, Any] = {
        "n_instances": n, "n_clusters": n_clusters, "n_decisions": len(sides), "accuracy": acc,
        "action_counts": counts, "follows_field": follows, "varies": follows > 0,
        "field_effect": summarize([r["field_effect"][mode] for r in rows], seed=seed,
                                  clusters=[r["scenario"] for r in rows]),
        "ld_old": summarize([r["reads"][mode]["old"]["ld"] for r in rows], seed=seed),
        "ld_new": summarize([r["reads"][mode]["new"]["ld"] for r in rows], seed=seed),
        "chance": CHANCE, "gate": p.gate}
    if mode == "chain":
        out["decided_by_chain"] = sum(x["decided_by"] == "chain" for _, x in sides) / len(sides)
        out["mean_chain_tokens"] = sum(x["chain_tokens"] for _, x in sides) / len(sides)
    if n < p.min_instances or n_clusters < p.min_clusters:
        out["competent"] = None
        out["verdict"] = (f"no verdict: {n} instances over {n_clusters} clusters (a verdict needs "
                          f">= {p.min_instances} and >= {p.min_clusters})")
        return out
    above = acc["ci_low"] is not None and acc["ci_low"] > CHANCE
    out["competent"] = is_competent(acc["mean"], acc["ci_low"], p.gate, CHANCE)
    out["verdict"] = ("competent" if out["competent"] else
                      f"below the gate: accuracy {acc['mean']:.2f} [{acc['ci_low']:.2f}, {acc['ci_high']:.2f}] "
                      + ("is above chance but under " if above else "is not above chance; gate ") + f"{p.gate:.2f}")
    return out


def summarize_rows(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, Any]:
    p = ctx.params
    cells = {task: {mode: cell(sub, mode, p, ctx.cfg.seed) for mode in p.modes}
             for task in p.tasks if (sub := [r for r in rows if r["task"] == task])}
    missing = [t for t in p.tasks if t not in cells]
    return {"n_instances": len(rows), "tasks": list(cells), "modes": p.modes, "cells": cells,
            "tasks_without_instances": missing, "chance": CHANCE, "gate": p.gate,
            "chain": {"decoding": "greedy", "chain_tokens": p.chain_tokens, "cue": p.cot_cue,
                      "decision": "last action the chain names, else forced after the answer cue"},
            "competent": sorted(f"{t}/{m}" for t, ms in cells.items() for m, c in ms.items() if c["competent"]),
            "prefilled_tokens": sum(r["prefilled_tokens"] for r in rows),
            "context_tokens": sum(r["context_tokens"] for r in rows)}


def _verdict_cell(c: dict[str, Any]) -> str:
    return "no verdict" if c["competent"] is None else ("yes" if c["competent"] else "no")


def table(s: dict[str, Any]) -> str:
    lines = [f"full-recompute competence (chance {s['chance']}, gate {s['gate']}); accuracy over 2 decisions per "
             "instance (old and new value), exact CI; field effect = LD(new) - LD(old), nats, cluster CI",
             f"{'task':<20}{'mode':<8}{'n/cl':<7}{'accuracy':<22}{'actions':<34}{'follow':<8}"
             f"{'field effect':<26}competent"]
    for task, by_mode in s["cells"].items():
        for mode, c in by_mode.items():
            acts = ", ".join(f"{k} {v}" for k, v in sorted(c["action_counts"].items()))
            lines.append(f"{task:<20}{mode:<8}{c['n_instances']}/{c['n_clusters']:<4}{ci_cell(c['accuracy']):<22}"
                         f"{acts[:33]:<34}{c['follows_field']:<8}{ci_cell(c['field_effect'], signed=True):<26}"
                         f"{_verdict_cell(c)}")
    return "\n".join(lines)


def headline(s: dict[str, Any]) -> str:
    comp = ", ".join(s["competent"]) or "none"
    return (f"competent (accuracy >= {s['gate']} and above chance): {comp}; "
            + "; ".join(f"{t} " + "/".join(f"{c['accuracy']['mean']:.2f}" for c in ms.values())
                        for t, ms in s["cells"].items()) + f" ({'/'.join(s['modes'])})")


EXPERIMENT = Experiment(
    section="screen",
    name="screen", doc=__doc__, params=Params, make_instances=make_instances, run_instance=run_instance,
    summarize=summarize_rows, table=table, headline=headline, needs_template=True,
    paper=paper_headlines("screen"),
    claims=())
