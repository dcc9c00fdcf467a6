"""External validity of composition on real conversational memory: LoCoMo (Maharana et al., 2024, "Evaluating
Very Long-Term Conversational Memory of LLM Agents", ACL), paper Section 7, Figure 11.

LoCoMo (:mod:`kvprobe.tasks.locomo`) holds ten very long multi-session conversations with QA annotations. Per
question the memory is the session(s) holding its evidence plus distractor sessions of the same conversation (drawn
at random per question, each added while the memory stays within ``memory_tokens``), in session order, placed late:
``[sys][MEM][question]`` with LoCoMo's own prompt wording. Two computations of the byte-identical token ids are compared:

- full recompute: the whole prompt prefilled;
- precompiled: each session a block prefilled alone (positions 0..L-1, once per conversation and reused across
  its questions), re-rotated to where it lands and spliced by the compose core (:mod:`kvprobe.kv.compose`);
  the system text before and the question after are prefilled live over it.

Measured per question: the QA accuracy of each as LoCoMo's token F1 of its bounded greedy answer against the
gold answer (the paper's test: TOST at margin 0.03 on the paired F1 difference, with conversations as the
clusters); the cosine of the first answer token's logits (full vocabulary); exact agreement of the two greedy
answers (token ids, up to ``max_answer_tokens`` or the first newline / end of turn). The control splices the
same blocks without re-rotation (keys left at their isolated positions): its cosine must fall below the
re-rotated one's.

Coverage: the adversarial category (5) has no gold answer and is skipped; of the 1,540 answerable questions a
stratified subset is run, ``task.n_instances`` split evenly over ``categories`` and drawn round-robin over the
conversations, among the questions whose evidence sessions fit the budget (the record states how many were
eligible per category). Where our setting differs: small CPU models with a memory of a few sessions
(``memory_tokens``) instead of the whole dialogue (~20k tokens); a 135M model answers LoCoMo poorly, so F1
is low and the F1 equivalence is weak evidence (two near-zero accuracies are close): the agreement measures,
which need no competent model, are the point.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvprobe.backends import HookableModel
from kvprobe.cache_dir import project_path
from kvprobe.claims import ACCURACY_MARGIN, KVPROBE_RATE_BOUND, Claim, near
from kvprobe.kv.compose import Live, Spliced, assemble, precompile
from kvprobe.kv.decode import greedy_chain
from kvprobe.kv.readout import prefill, read_logits
from kvprobe.kv.state import KVState
from kvprobe.metrics import logit_cosine
from kvprobe.probes.summary import ci_cell
from kvprobe.runner.experiment import Context, Experiment
from kvprobe.stats.bootstrap import cluster_means, summarize
from kvprobe.stats.inference import summarize_proportion, tost_paired
from kvprobe.tasks.gated import render
from kvprobe.tasks.locomo import ANSWERABLE, CATEGORIES, Conversation, load_locomo, locomo_f1
from kvprobe.paper import headlines as paper_headlines

ARMS = ("full", "spliced")
_MARK = "<<MEMORY>>"  # where the sessions go inside the (chat-wrapped) prompt


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    data: str = Field("../shared/data/locomo/locomo10.zip", description="LoCoMo release archive (or folder of its "
                      "JSON files); relative paths resolve against the working directory, then the repository root")
    memory_tokens: int = Field(1536, ge=64, description="token budget of the memory (evidence + distractor sessions)")
    categories: list[int] = Field(default_factory=lambda: list(ANSWERABLE), min_length=1,
                                  description="LoCoMo categories run (1 multi-hop, 2 temporal, 3 open-domain, "
                                              "4 single-hop); task.n_instances is split evenly over them")
    max_answer_tokens: int = Field(12, ge=1, description="bound of each greedy answer")


@dataclass(frozen=True)
class LocomoInstance:
    index: int
    scenario: str  # the conversation's sample id: the cluster
    qa_index: int
    category: int
    memory: tuple[int, ...]  # session numbers in the memory, in order
    evidence: tuple[int, ...]

    def row(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "qa_index": self.qa_index, "category": self.category,
                "category_name": CATEGORIES[self.category], "memory_sessions": list(self.memory),
                "evidence_sessions": list(self.evidence)}


def _conversations(ctx: Context) -> dict[str, Conversation]:
    if "conversations" not in ctx.scratch:
        path = project_path(ctx.params.data)
        ctx.scratch["conversations"] = {c.sample_id: c for c in load_locomo(path, "params.data")}
    return ctx.scratch["conversations"]


def _session_ids(ctx: Context, conv: Conversation, number: int) -> list[int]:
    tok = ctx.lm.tokenizer
    return list(tok(conv.session(number).render(), add_special_tokens=False)["input_ids"])


def make_instances(ctx: Context) -> list[Any]:
    """The stratified subset: per category, questions whose evidence fits the budget, round-robin over the
    conversations (each conversation's order shuffled by the seed); distractors drawn per question."""
    p, seed = ctx.params, ctx.cfg.seed
    convs = _conversations(ctx)
    lengths = {(sid, s.number): len(_session_ids(ctx, c, s.number)) for sid, c in convs.items() for s in c.sessions}
    cats = list(dict.fromkeys(p.categories))
    eligible: dict[int, dict[str, list[int]]] = {c: {} for c in cats}
    answerable = {c: 0 for c in cats}
    for sid, conv in convs.items():
        have = {s.number for s in conv.sessions}
        for qi, qa in enumerate(conv.qa):
            if qa.category not in eligible or not qa.answerable:
                continue
            answerable[qa.category] += 1
            ev = qa.evidence_sessions
            if ev and set(ev) <= have and sum(lengths[sid, s] for s in ev) <= p.memory_tokens:
                eligible[qa.category].setdefault(sid, []).append(qi)
    n = ctx.cfg.task.n_instances
    picked: list[tuple[str, int]] = []
    for j, cat in enumerate(cats):
        want = n // len(cats) + (1 if j < n % len(cats) else 0)
        rng = random.Random(f"{seed}:{cat}")
        queues = {sid: rng.sample(qs, len(qs)) for sid, qs in sorted(eligible[cat].items())}
        order = rng.sample(sorted(queues), len(queues))
        got = 0
        while got < want and any(queues.values()):
            for sid in order:
                if queues[sid] and got < want:
                    picked.append((sid, queues[sid].pop()))
                    got += 1
    ctx.scratch["coverage"] = {CATEGORIES[c]: {"answerable": answerable[c], "eligible": sum(
        len(q) for q in eligible[c].values()), "conversations_eligible": len(eligible[c])} for c in cats}
    out = []
    for i, (sid, qi) in enumerate(sorted(picked, key=lambda t: (t[0], convs[t[0]].qa[t[1]].category, t[1]))):
        conv, qa = convs[sid], convs[sid].qa[qi]
        ev = qa.evidence_sessions
        used = sum(lengths[sid, s] for s in ev)
        mem = set(ev)
        rng = random.Random(f"{seed}:{sid}:{qi}")
        for s in rng.sample([s.number for s in conv.sessions if s.number not in mem], len(conv.sessions) - len(mem)):
            if used + lengths[sid, s] <= p.memory_tokens:
                mem.add(s)
                used += lengths[sid, s]
        out.append(LocomoInstance(i, sid, qi, qa.category, tuple(sorted(mem)), ev))
    return out


def _prompt(lm: HookableModel, conv: Conversation, question: str) -> tuple[list[int], list[int]]:
    """Token ids before the memory (chat prefix + system text) and after it (the question, ending where the
    answer starts)."""
    tok = lm.tokenizer
    text, special = render(tok, conv.system() + _MARK + question, lm.has_chat_template)
    before, after = text.split(_MARK)
    return (list(tok(before, add_special_tokens=special)["input_ids"]),
            list(tok(after, add_special_tokens=False)["input_ids"]))


def _block(ctx: Context, sid: str, number: int) -> tuple[tuple[int, ...], KVState]:
    """A session precompiled alone, once per conversation (the runner orders instances by conversation)."""
    cache = ctx.scratch.setdefault("blocks", {})
    if cache and next(iter(cache))[0] != sid:
        cache.clear()  # one conversation's blocks held at a time
    if (sid, number) not in cache:
        ids = tuple(_session_ids(ctx, _conversations(ctx)[sid], number))
        cache[sid, number] = (ids, precompile(ctx.lm, ids))
    return cache[sid, number]


def question_prompt(ctx: Context, sid: str, memory: tuple[int, ...], question: str) -> tuple[list[int], int, int]:
    """The full-recompute prompt of ``question`` over the sessions ``memory`` of conversation ``sid``: its token
    ids, and how many lead (system text) and trail (question) tokens surround the memory."""
    conv = _conversations(ctx)[sid]
    head, tail = _prompt(ctx.lm, conv, question)
    return head + [t for s in memory for t in _session_ids(ctx, conv, s)] + tail, len(head), len(tail)


def conversations(ctx: Context) -> dict[str, Conversation]:
    """The LoCoMo conversations of ``params.data`` by sample id (read once per run)."""
    return _conversations(ctx)


def _stop_ids(ctx: Context) -> list[int]:
    """End of turn, and every token that starts a new line: a LoCoMo answer is one short phrase."""
    if "stop_ids" not in ctx.scratch:
        tok = ctx.lm.tokenizer
        nl = [i for i in range(len(tok)) if "\n" in tok.decode([i])]
        ctx.scratch["stop_ids"] = sorted({*nl, *([tok.eos_token_id] if tok.eos_token_id is not None else [])})
    return ctx.scratch["stop_ids"]


def _answer(ctx: Context, chain: list[int]) -> tuple[list[int], str]:
    stops = set(_stop_ids(ctx))
    ids = chain[:-1] if chain and chain[-1] in stops else chain
    text = ctx.lm.tokenizer.decode(ids, skip_special_tokens=True)
    return ids, text.split("\n")[0].strip()


def run_instance(ctx: Context, inst: Any) -> dict[str, Any]:
    lm, p = ctx.lm, ctx.params
    conv = _conversations(ctx)[inst.scenario]
    qa = conv.qa[inst.qa_index]
    head, tail = _prompt(lm, conv, qa.render())
    blocks = [_block(ctx, inst.scenario, s) for s in inst.memory]
    ids = head + [t for b, _ in blocks for t in b] + tail
    full = prefill(lm, ids[:-1])

    def spliced(rotate: bool) -> KVState:
        return assemble(lm, [Live(tuple(head)), *(Spliced(b, st, rotate=rotate) for b, st in blocks),
                             Live(tuple(tail[:-1]))])

    states = {"full": full, "spliced": spliced(True), "no_rotation": spliced(False)}
    logits = read_logits(lm, list(states.values()), ids[-1:], batch_size=ctx.cfg.batch_size)
    first = {name: int(logits[i].argmax()) for i, name in enumerate(states)}
    row: dict[str, Any] = {**inst.row(), "question": qa.question, "gold": qa.answer, "n_tokens": len(ids),
                           "memory_tokens": len(ids) - len(head) - len(tail),
                           "cosine": float(logit_cosine(logits[1], logits[0])),
                           "no_rotation_cosine": float(logit_cosine(logits[2], logits[0])),
                           "first_token_agree": first["spliced"] == first["full"],
                           "no_rotation_first_token_agree": first["no_rotation"] == first["full"]}
    answers = {}
    for arm in ARMS:
        _, chain = greedy_chain(lm, states[arm], ids[-1:], p.max_answer_tokens, _stop_ids(ctx))
        answers[arm] = _answer(ctx, chain)
        row[arm] = {"answer": answers[arm][1], "f1": locomo_f1(answers[arm][1], qa.answer or "", qa.category)}
    row["answer_agree"] = answers["spliced"][0] == answers["full"][0]
    return row


def _prop(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    return summarize_proportion([bool(r[key]) for r in rows], [r["scenario"] for r in rows])


def _mean(rows: list[dict[str, Any]], values: list[float], seed: int) -> dict[str, Any]:
    return summarize(values, seed=seed, clusters=[r["scenario"] for r in rows])


def _block_summary(rows: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    out = {"n": len(rows), "n_conversations": len(set(r["scenario"] for r in rows)),
           "f1": {arm: _mean(rows, [r[arm]["f1"] for r in rows], seed) for arm in ARMS},
           "f1_difference": _mean(rows, [r["spliced"]["f1"] - r["full"]["f1"] for r in rows], seed),
           "cosine": _mean(rows, [r["cosine"] for r in rows], seed),
           "no_rotation_cosine": _mean(rows, [r["no_rotation_cosine"] for r in rows], seed),
           "answer_agreement": _prop(rows, "answer_agree"),
           "first_token_agreement": _prop(rows, "first_token_agree"),
           "no_rotation_first_token_agreement": _prop(rows, "no_rotation_first_token_agree")}
    return out


def summarize_rows(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, Any]:
    seed = ctx.cfg.seed
    cl = [r["scenario"] for r in rows]
    _, spliced_f1 = cluster_means([r["spliced"]["f1"] for r in rows], cl)
    _, full_f1 = cluster_means([r["full"]["f1"] for r in rows], cl)
    out = {"n_instances": len(rows), **_block_summary(rows, seed),
           "coverage": ctx.scratch.get("coverage"),
           "tost_f1": tost_paired(list(spliced_f1), list(full_f1), -ACCURACY_MARGIN, ACCURACY_MARGIN) | {
               "unit": "conversation means"},
           "memory_tokens": summarize([r["memory_tokens"] for r in rows]),
           "memory_sessions": summarize([len(r["memory_sessions"]) for r in rows]),
           "seconds_per_question": summarize([r["seconds"] for r in rows if "seconds" in r]),
           "by_category": {CATEGORIES[c]: _block_summary(sub, seed) for c in ctx.params.categories
                           if (sub := [r for r in rows if r["category"] == c])}}
    out["verdict_note"] = ("F1 is the model's QA accuracy; on a small model it is low, so the F1 equivalence says "
                           "little (two low accuracies are close) and the agreement measures (answer agreement, "
                           "logit cosine) are the finding")
    return out


def table(s: dict[str, Any]) -> str:
    lines = [f"{s['n_instances']} questions over {s['n_conversations']} conversations; memory "
             f"{s['memory_tokens']['mean']:.0f} tokens ({s['memory_sessions']['mean']:.1f} sessions); "
             f"{s['seconds_per_question']['mean'] or 0:.1f} s per question",
             f"{'category':<12}{'n':>4}  {'F1 full':<20}{'F1 spliced':<20}{'answers agree':<22}{'cosine':<22}"
             f"{'cos no-rot':<12}"]
    for name, b in {**s["by_category"], "all": s}.items():
        lines.append(f"{name:<12}{b['n']:>4}  {ci_cell(b['f1']['full']):<20}{ci_cell(b['f1']['spliced']):<20}"
                     f"{ci_cell(b['answer_agreement']):<22}{ci_cell(b['cosine'], 4):<22}"
                     f"{b['no_rotation_cosine']['mean']:.4f}")
    t = s["tost_f1"]
    p = "n/a" if t.get("p") is None else f"{t['p']:.3g}"
    lines.append(f"F1 spliced - full {ci_cell(s['f1_difference'], 4, signed=True)}; TOST +-{ACCURACY_MARGIN} on "
                 f"conversation means p {p}. {s['verdict_note']}")
    return "\n".join(lines)


def headline(s: dict[str, Any]) -> str:
    return (f"F1 full {s['f1']['full']['mean']:.3f} vs spliced {s['f1']['spliced']['mean']:.3f} "
            f"(diff {s['f1_difference']['mean']:+.3f}); answers agree {s['answer_agreement']['mean']:.2f}; "
            f"cos {s['cosine']['mean']:.4f} (no rotation {s['no_rotation_cosine']['mean']:.3f}); "
            f"n {s['n_instances']} ({s['n_conversations']} conversations)")


PAPER_N = "1,540 answerable questions per model (four models)"
EXPERIMENT = Experiment(
    section="sec7", section_order=2,
    name="locomo", doc=__doc__, params=Params, make_instances=make_instances, run_instance=run_instance,
    summarize=summarize_rows, table=table, headline=headline,
    paper=paper_headlines("locomo"),
    claims=(
        near("locomo_f1_equivalent", "spliced sessions answer LoCoMo as accurately as full recompute (paired token-F1 "
             "difference within +-0.03; weak where F1 is low)", "spliced.f1", 0.0, margin=ACCURACY_MARGIN, b="full.f1", gated=False,
             role="effect", competence=("full.f1",)),
        Claim("locomo_answer_cosine", "the first answer token's logits of the spliced memory match full recompute "
              "(cosine above App. H's 0.98)", "describe", "cosine", 0.98, gated=False, role="effect", competence=("full.f1",), described="a near-construction: full-vocabulary cosine ranks a wrong memory (0.99941) above the right splice (0.99922)"),
        Claim("locomo_answer_agreement", "the spliced memory's greedy answer is the full recompute's, token for token", "at_least",
              "answer_agree", bound=KVPROBE_RATE_BOUND, gated=False, role="effect", competence=("full.f1",)),
        Claim("locomo_first_token_agreement", "the spliced memory's first answer token is the full recompute's", "at_least",
              "first_token_agree", bound=KVPROBE_RATE_BOUND, gated=False, role="effect", competence=("full.f1",)),
        # both controls can fail: were the positions irrelevant to the model, unrotated keys would match as well
        Claim("locomo_rotation_decision_control", "re-rotated sessions give full recompute's first answer token more "
              "often than unrotated ones (paired)", "greater",
              "first_token_agree", "no_rotation_first_token_agree", gated=False, role="control", competence=("full.f1",)),
        Claim("locomo_rotation_control", "re-rotated sessions' answer-token logits are closer to full recompute "
              "than unrotated ones (paired)", "greater", "cosine",
              "no_rotation_cosine", gated=False, role="control", competence=("full.f1",)),
    ))
