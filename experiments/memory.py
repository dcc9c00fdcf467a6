"""User memory as a composed and edited set of notes (paper Section 7: E1 placement, E2 transplant, E3
mid-session edit, E4 granularity; Figures 8, 9, 10, 24).

A persona memory (:func:`kvprobe.tasks.memory.persona_instance`: a catalogue of on/off settings among filler
notes; the request is allowed only if every relevant setting is enabled, an AND; labels alternate) sits late,
``[sys][traj][MEM][query]``. Every comparison is with a full recompute of the byte-identical tokens.

- E1 placement, under full recompute: the same user's memory at each length of ``e1_lines`` (memory lines;
  the settings and the request stay, the filler grows), read early ``[sys][MEM][traj][query]`` or late, and
  decided directly or after a bounded greedy reasoning chain (:func:`kvprobe.probes.chain.chain_decision`:
  cue, at most ``chain_tokens`` greedy tokens, the last action word named, else the forced answer).
  Accuracy per placement x mode x length with exact intervals; GEE-logistic (exchangeable within the lead
  setting, robust SE) of correctness on placement (reference early: the paper's beta_late) per mode, and on
  length (reference the shortest) per mode and placement.

- E2 transplant: the memory precompiled alone, re-rotated and spliced, with 0 and 1 seam-repair tokens; the
  no-rotation control (keys left at their isolated positions) on the same instances.
- E4 granularity: the memory cut at line boundaries into S independently precompiled blocks (S from
  ``blocks``); agreement and cosine against S; the relevant facts lie contiguous or split (``layouts``),
  crossed with the label (instance i takes ``layouts[(i // layout_period) % n]``, period 2 by default; the label
  alternates with i); the edit cost per S is one block's tokens over the memory's.
- E3 edit: one relevant stored fact toggled (the decision flips) over the spliced (seam 1) cache: stale,
  in_place (the value's tokens recomputed), erratum (a ``[MEMORY UPDATE]`` line appended after the memory,
  the cache reused up to it) and field+erratum, each read directly and after the chain (``modes``);
  P(correct) is the rate of the new decision; McNemar erratum vs in_place per mode. The negative control
  toggles an irrelevant setting: under full recompute the decision must not move.

Graded measures and must-fail controls (:mod:`kvprobe.probes.graded`). Every E2/E4 arm carries its two-action
logit difference (``<arm>_ld``, right minus wrong action, nats) and its distance from full recompute's; E1 cells and
E3 methods their LD. ``field_effect`` rebuilds every arm on the memory with E3's relevant setting toggled, so each
arm's *field effect retained* (its LD change over full recompute's) is read even where every decision is the
same. ``controls`` adds arms that must fail, each reported beside its treatment with the separation (control's
LD error minus the treatment's) and its cluster CI: ``no_rotation_far`` (the whole context moved ``far_offset``
positions up, so the memory lands >= that far from where it was precompiled, spliced without re-rotation; its
treatment ``seam0_far`` is the re-rotated splice at the same offset), ``shuffled`` (``shuffle_blocks`` blocks
spliced in reverse order; treatment the same blocks in order), ``wrong_memory`` (another user's memory spliced in
its place), ``no_memory`` (the memory left out), ``ablated`` (the relevant setting lines cut out) and ``stale``
(with ``field_effect``: the old memory's full-recompute cache read for the toggled memory; retained 0 by
construction); the treatment of the last four is ``seam0``.

Direct decisions are the argmax of the two action tokens (`` allow`` / `` refuse``) after ``Decision:``; every
cache ends where that answer prefix begins, so a chain can start there. Reads go through the probe layer's
decision API (:mod:`kvprobe.probes.decision`), splices through :func:`kvprobe.kv.compose.splice_spans`. Where our setting differs: small CPU
models (a 135M model decides an AND over two settings near chance, which the record's full-recompute
accuracy shows), instruction-tuned rather than reasoning-native (the chain is induced by a cue and short),
and memories of ~0.4k to ~1k tokens rather than 2k to 32k (the record states the lengths).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvprobe.backends import HookableModel, KVState
from kvprobe.claims import ACCURACY_MARGIN, RETAINED_MARGIN, SEPARATION_MARGIN, Claim
from kvprobe.kv import edit
from kvprobe.kv.compose import Compiled, splice_spans
from kvprobe.kv.edit import FieldEdit
from kvprobe.kv.readout import prefill
from kvprobe.metrics import logit_cosine
from kvprobe.probes.decision import ChainSpec, answer_prefix_len, decide, read_actions, read_named
from kvprobe.probes.graded import (FAR_OFFSET, arm_entry, arms_summary, control_entry, controls_headline,
                                   controls_summary, far_check, field_effect_retained, graded_lines, pick)
from kvprobe.probes.summary import ci_cell, summarize_column
from kvprobe.runner.experiment import Context, Experiment
from kvprobe.stats.bootstrap import summarize
from kvprobe.stats.inference import gee_binomial, mcnemar_exact, summarize_proportion
from kvprobe.tasks.gated import render
from kvprobe.tasks.memory import ANSWER_PREFIX, PLACEMENTS, VALUES, action_ids, persona_instance, render_ids
from kvprobe.paper import headlines as paper_headlines
from kvprobe.schema import distinct_subset, hash_neutral

EDITS = ("stale", "in_place", "erratum", "field_erratum")
MODES = ("direct", "chain")
# must-fail controls -> their treatment (the arm the control is read beside)
CONTROLS = {"no_rotation_far": "seam0_far", "shuffled": "blocks{s}", "wrong_memory": "seam0", "no_memory": "seam0",
            "ablated": "seam0", "stale": "seam0"}


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    n_lines: int = Field(40, ge=10, description="memory lines (8 settings + filler notes); ~12 tokens a line")
    n_relevant: int = Field(2, ge=1, le=4, description="settings the request ANDs over")
    seam_repair: list[int] = Field(default_factory=lambda: [0, 1])
    blocks: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16], description="E4: numbers of blocks S")
    layouts: list[str] = Field(default_factory=lambda: ["contiguous", "split"],
                               description="relevant facts contiguous or split, crossed with the label (which "
                                           "alternates with i): instance i takes layouts[(i // layout_period) % n]")
    # Records written before it gave instance i layouts[i % 2] (period 1), so every contiguous instance was 'allow'
    # and every split one 'refuse'. The crossed default (2) enters the hash, so it never shares their names; those
    # records state period 1 (migrated once) and keep theirs.
    layout_period: int = hash_neutral(2, neutral=1, ge=1,
                                      description="E4: instances per layout before the next one (even: each layout "
                                                  "meets both labels equally often; 1: the first records' design, "
                                                  "layout in step with the label, kept only to name those records)")
    edit: bool = Field(True, description="run E3 (toggle one stored fact)")
    modes: list[str] = Field(default_factory=lambda: ["direct", "chain"],
                             description="E1 and E3: decide directly and/or after a greedy chain")
    chain_tokens: int = Field(12, ge=1, le=512, description="greedy chain budget (tokens); short on a CPU")
    cot_cue: str = Field("Let me check each required setting in the user memory.",
                         description="run over the cache before the chain")
    e1_lines: list[int] = Field(default_factory=lambda: [40, 100],
                                description="E1: memory lines per length (~12 tokens a line); [] skips E1")
    placements: list[str] = Field(default_factory=lambda: ["early", "late"], description="E1 placements")
    field_effect: bool = hash_neutral(False, description="E2/E4: every arm also built on the memory with one "
                                                         "relevant setting toggled; each arm's field effect retained")
    controls: list[str] = hash_neutral([], description="must-fail controls beside their treatment: "
                                       + ", ".join(CONTROLS) + " ('stale' needs field_effect)")
    far_offset: int = hash_neutral(FAR_OFFSET, ge=2000, description="no_rotation_far: the context moved this many "
                                   "positions up (the memory lands >= this far from where it was precompiled)")
    shuffle_blocks: int = hash_neutral(4, ge=2, description="shuffled: blocks spliced in reverse order")

    @field_validator("controls")
    @classmethod
    def _controls(cls, v: list[str]) -> list[str]:
        return pick(v, list(CONTROLS), "controls")

    @field_validator("layout_period")
    @classmethod
    def _layout_period(cls, v: int) -> int:
        if v % 2 and v != 1:
            raise ValueError(f"layout_period must be even (the label alternates with i), got {v}")
        return v

    @field_validator("modes")
    @classmethod
    def _modes(cls, v: list[str]) -> list[str]:
        return distinct_subset(v, MODES, "modes")

    @field_validator("placements")
    @classmethod
    def _placements(cls, v: list[str]) -> list[str]:
        return distinct_subset(v, PLACEMENTS, "placements")

    @field_validator("e1_lines")
    @classmethod
    def _lines(cls, v: list[int]) -> list[int]:
        if any(n < 10 for n in v) or v != sorted(set(v)):
            raise ValueError(f"e1_lines must be distinct, ascending and each >= 10; got {v}")
        return v

    @model_validator(mode="after")
    def _enough_lines(self) -> "Params":
        if max(self.blocks) > self.n_lines:
            raise ValueError(f"{max(self.blocks)} blocks need at least as many memory lines; n_lines={self.n_lines}")
        if "shuffled" in self.controls and self.shuffle_blocks > self.n_lines:
            raise ValueError(f"shuffle_blocks={self.shuffle_blocks} exceeds n_lines={self.n_lines}")
        if "stale" in self.controls and not self.field_effect:
            raise ValueError("the stale control reads the toggled memory: set field_effect=true")
        return self

    @field_validator("blocks")
    @classmethod
    def _blocks(cls, v: list[int]) -> list[int]:
        if not v or v[0] != 1 or v != sorted(set(v)):
            raise ValueError(f"blocks must start at 1 and be distinct and ascending; got {v}")
        return v


def make_instances(ctx: Context) -> list[Any]:
    p = ctx.params
    # the label alternates with i (persona_instance): the layout changes every two instances, so each layout
    # meets both labels (layouts[i % n] would make contiguous always 'allow' and split always 'refuse')
    return [persona_instance(i, ctx.cfg.seed, p.n_lines, n_relevant=p.n_relevant,
                             layout=p.layouts[(i // p.layout_period) % len(p.layouts)])
            for i in range(ctx.cfg.task.n_instances)]


def _cuts(starts: list[int], s: int) -> list[int]:
    n = len(starts) - 1
    return sorted({starts[round(i * n / s)] for i in range(s + 1)})


def _spliced(lm: HookableModel, ids: list[int], starts: list[int], r: int, s: int = 1, seam: int = 0,
             rotate: bool = True, compiled: Compiled | None = None, start: int = 0) -> KVState:
    """The memory cut into ``s`` blocks at line boundaries, each precompiled alone and spliced between the live
    head and the live tail (:func:`kvprobe.kv.compose.splice_spans`); the cache ends ``r`` tokens (the answer
    prefix) before the prompt's end."""
    return splice_spans(lm, ids, _cuts(starts, s), len(ids) - r, seam=seam, rotate=rotate, start=start,
                        compiled=compiled)


def answer_tokens(ctx: Context, inst: Any, ids: list[int]) -> int:
    """How many final prompt tokens the answer prefix takes (the cache ends before them)."""
    text, special = render(ctx.lm.tokenizer, inst.body(), ctx.lm.has_chat_template)
    return answer_prefix_len(ctx.lm.tokenizer, ids, text, special)


def _chain(ctx: Context) -> ChainSpec:
    tok, p = ctx.lm.tokenizer, ctx.params
    return ChainSpec(tuple(tok(p.cot_cue, add_special_tokens=False)["input_ids"]),
                     tuple(tok("\n" + ANSWER_PREFIX, add_special_tokens=False)["input_ids"]), p.chain_tokens)


def _decide(ctx: Context, mode: str, state: Any, suffix: list[int], actions: tuple[str, str],
            tokens: tuple[int, int]) -> dict[str, Any]:
    """The decision over ``state`` (a cache ending where the answer prefix ``suffix`` begins): direct, the
    argmax of the two action tokens after the prefix; chain, after a bounded greedy chain
    (:func:`kvprobe.probes.decision.decide`). ``ld``: actions[0] minus actions[1] (the chain's forced read)."""
    d = decide(ctx.lm, state, suffix, tokens, actions, mode, _chain(ctx) if mode == "chain" else None)  # type: ignore[arg-type]
    out: dict[str, Any] = {"decision": actions[d.choice], "ld": d.ld}
    if mode == "chain":
        out.update(decided_by=d.decided_by, n_tokens=d.chain_tokens, text=d.chain_text)
    return out


def _e1_rows(ctx: Context, inst: Any, known: tuple[list[int], Any]) -> list[dict[str, Any]]:
    """E1: full-recompute decisions of the same user at each memory length, placement and mode. ``known``: the
    instance's own prompt ids and full-recompute cache (late, ``n_lines``), reused where E1 meets it."""
    lm, tok, p = ctx.lm, ctx.lm.tokenizer, ctx.params
    out = []
    for n_lines in p.e1_lines:
        for placement in p.placements:
            x = persona_instance(inst.index, ctx.cfg.seed, n_lines, n_relevant=p.n_relevant,
                                 layout=inst.meta["layout"], placement=placement)
            ids, starts, prompt, special = render_ids(tok, x, lm.has_chat_template)
            r = answer_tokens(ctx, x, ids)
            acts = (x.action, x.other_action)
            tokens = tuple(action_ids(tok, prompt, ids, special, acts))
            state = known[1] if ids == known[0] else prefill(lm, ids[:-r])
            for mode in p.modes:
                d = _decide(ctx, mode, state, ids[-r:], acts, tokens)
                out.append({"lines": n_lines, "memory_tokens": starts[-1] - starts[0], "n_tokens": len(ids),
                            "placement": placement, "mode": mode, "correct": d["decision"] == x.action,
                            **{k: v for k, v in d.items() if k != "decision"}})
    return out


def _toggled(ctx: Context, inst: Any) -> tuple[Any, list[int], list[int], str, bool]:
    """E3's toggle: one relevant stored fact flipped (the decision flips): the instance, its prompt ids, line
    starts, prompt text and special-token flag."""
    old_v = inst.value_of(inst.toggle)
    new = inst.with_value(inst.toggle, VALUES[1 - VALUES.index(old_v)])
    return (new, *render_ids(ctx.lm.tokenizer, new, ctx.lm.has_chat_template))


def _edit_row(ctx: Context, inst: Any, ids: list[int], r: int, base: Any, full_ld: float) -> dict[str, Any]:
    """E3: toggle one relevant fact over the spliced cache ``base`` of the old memory; every method read in
    every mode. ``full_ld``: full recompute's LD of the old prompt (old action minus new)."""
    lm, tok, chat, p = ctx.lm, ctx.lm.tokenizer, ctx.lm.has_chat_template, ctx.params
    old_v = inst.value_of(inst.toggle)
    new_v = VALUES[1 - VALUES.index(old_v)]
    new, new_ids, _, new_prompt, special = _toggled(ctx, inst)
    if len(new_ids) != len(ids):
        return {"skipped": f"'{old_v}' and '{new_v}' tokenize to different lengths here"}
    slots = [i for i, (a, b) in enumerate(zip(ids, new_ids)) if a != b]
    acts = (new.action, inst.action)
    tokens = tuple(action_ids(tok, new_prompt, new_ids, special, acts))
    e = FieldEdit(base, ids[:-r], new_ids[:-r], slots, ids[-r:])
    line = f"[MEMORY UPDATE] {inst.toggle}: {new_v}"

    def erratum_ids(memory_inst: Any) -> list[int]:
        text, sp = render(tok, memory_inst.body(erratum=line), chat)
        return list(tok(text + ANSWER_PREFIX, add_special_tokens=sp)["input_ids"])

    results = {"stale": edit.stale(e), "in_place": edit.in_place(lm, e),
               "erratum": edit.erratum(lm, e, erratum_ids(inst), r),
               "field_erratum": edit.field_erratum(lm, e, erratum_ids(new), r)}
    row: dict[str, Any] = {"field_slots": slots}
    for name, res in results.items():
        row[name] = {"recompute_fraction": res.recompute_fraction}
        for mode in p.modes:
            d = _decide(ctx, mode, res.state, res.suffix_ids, acts, tokens)
            row[name][mode] = d["decision"] == new.action
            row[name][f"ld_{mode}"] = d["ld"]  # new action minus old (the chain's forced read)
            if mode == "chain":
                row[name]["chain_decided_by"] = d["decided_by"]
        row[name]["correct"] = row[name][p.modes[0]]
    oracle = prefill(lm, new_ids[:-r])
    oracle_reads = {mode: _decide(ctx, mode, oracle, new_ids[-r:], acts, tokens) for mode in p.modes}
    row["oracle"] = {mode: d["decision"] == new.action for mode, d in oracle_reads.items()}
    row["oracle_correct"] = row["oracle"][p.modes[0]]
    if "direct" in p.modes:  # field effect retained: (method - stale) / (oracle - full recompute of the old memory)
        row["oracle_ld"] = oracle_reads["direct"]["ld"]
        for name in results:
            row[name]["retained"] = field_effect_retained(row[name]["ld_direct"], row["stale"]["ld_direct"],
                                                          row["oracle_ld"], -full_ld)
    # negative control: an irrelevant setting toggled; under full recompute the decision must stay
    irr = inst.with_value(inst.irrelevant, VALUES[1 - VALUES.index(inst.value_of(inst.irrelevant))])
    irr_ids, _, _, _ = render_ids(tok, irr, chat)
    right, wrong = tokens[1], tokens[0]  # the old action's token first: the decision before the toggle
    irr_ld = read_actions(lm, prefill(lm, irr_ids[:-r]), irr_ids[-r:], (right, wrong)).ld()
    row["irrelevant_toggle_kept"] = bool((full_ld > 0) == (irr_ld > 0))
    row["irrelevant_toggle_ld"] = irr_ld
    return row


def _memory_ids(ctx: Context, inst: Any, ids: list[int], starts: list[int], r: int) -> dict[str, list[int]]:
    """The content controls' prompts (the cache then ends ``r`` tokens before their end, at the same answer
    prefix): another user's memory in place of this one, no memory, the relevant setting lines cut out."""
    p, tok = ctx.params, ctx.lm.tokenizer
    m0, m1 = starts[0], starts[-1]
    out: dict[str, list[int]] = {}
    if "wrong_memory" in p.controls:  # another user (the next index under another seed), the same layout and length
        other = persona_instance(inst.index + 1, ctx.cfg.seed + 1, p.n_lines, n_relevant=p.n_relevant,
                                 layout=inst.meta["layout"], placement=inst.placement)
        o_ids, o_starts, _, _ = render_ids(tok, other, ctx.lm.has_chat_template)
        out["wrong_memory"] = ids[:m0] + o_ids[o_starts[0]:o_starts[-1]] + ids[m1:]
    if "no_memory" in p.controls:
        out["no_memory"] = ids[:m0] + ids[m1:]
    if "ablated" in p.controls:
        cut = {inst.setting_line[s] for s in inst.relevant}
        out["ablated"] = ids[:m0] + [t for i in range(len(starts) - 1) if i not in cut
                                      for t in ids[starts[i]:starts[i + 1]]] + ids[m1:]
    return out


def _arm_states(ctx: Context, inst: Any, ids: list[int], starts: list[int], r: int,
                compiled: Compiled) -> tuple[dict[str, Any], dict[str, Any]]:
    """The E2/E4 arms (seam{k}, no_rotation, blocks{S}) as the records have always had them, and the controls'
    arms (with the treatments they need beyond those)."""
    lm, p = ctx.lm, ctx.params
    states = {f"seam{k}": _spliced(lm, ids, starts, r, seam=k, compiled=compiled) for k in p.seam_repair}
    states["no_rotation"] = _spliced(lm, ids, starts, r, rotate=False, compiled=compiled)
    states |= {f"blocks{s}": _spliced(lm, ids, starts, r, s, compiled=compiled) for s in p.blocks if s > 1}
    extra: dict[str, Any] = {}
    if "no_rotation_far" in p.controls:
        extra["seam0_far"] = _spliced(lm, ids, starts, r, compiled=compiled, start=p.far_offset)
        extra["no_rotation_far"] = _spliced(lm, ids, starts, r, rotate=False, compiled=compiled, start=p.far_offset)
    if "shuffled" in p.controls:
        s = p.shuffle_blocks
        cuts = _cuts(starts, s)
        if f"blocks{s}" not in states:
            extra[f"blocks{s}"] = splice_spans(lm, ids, cuts, len(ids) - r, compiled=compiled)
        extra["shuffled"] = splice_spans(lm, ids, cuts, len(ids) - r, order=list(range(len(cuts) - 2, -1, -1)),
                                         compiled=compiled)
    for name, other in _memory_ids(ctx, inst, ids, starts, r).items():
        if name == "no_memory":
            extra[name] = prefill(lm, other[:-r])
        else:  # the other memory spliced as one block where this one was, as the treatment seam0 is
            mem_end = len(other) - (len(ids) - starts[-1])
            extra[name] = splice_spans(lm, other, [starts[0], mem_end], len(other) - r, compiled=compiled)
    return states, extra


def _control_names(p: Params) -> dict[str, str]:
    return {c: t.format(s=p.shuffle_blocks) for c, t in CONTROLS.items() if c in p.controls}


def run_instance(ctx: Context, inst: Any) -> dict[str, Any]:
    lm, tok, p = ctx.lm, ctx.lm.tokenizer, ctx.params
    ids, starts, prompt, special = render_ids(tok, inst, lm.has_chat_template)
    r = answer_tokens(ctx, inst, ids)
    right, wrong = action_ids(tok, prompt, ids, special, (inst.action, inst.other_action))
    full_state = prefill(lm, ids[:-r])
    full_read = read_actions(lm, full_state, ids[-r:], (right, wrong))
    full, full_ld = full_read.logits[0], full_read.ld()
    full_right = full_ld > 0
    compiled: Compiled = {}
    states, extra = _arm_states(ctx, inst, ids, starts, r, compiled)
    reads = read_actions(lm, list(states.values()), ids[-r:], (right, wrong), batch_size=ctx.cfg.batch_size)
    mem = starts[-1] - starts[0]
    row: dict[str, Any] = {**inst.row(), "included": True, "n_tokens": len(ids), "memory_tokens": mem,
                           "answer_prefix_tokens": r, "full_correct": full_right, "full_ld": full_ld}
    arms: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(states):
        row[f"{name}_agree"] = (reads.ld(i) > 0) == full_right
        row[f"{name}_cosine"] = float(logit_cosine(reads.logits[i], full))
        row[f"{name}_ld"] = reads.ld(i)
        arms[name] = arm_entry(reads.ld(i), full_ld, agree=row[f"{name}_agree"])
    for name, rd in read_named(lm, extra, ids[-r:], (right, wrong), ctx.cfg.batch_size).items():
        arms[name] = arm_entry(rd.ld(), full_ld, agree=(rd.ld() > 0) == full_right,
                               cosine=float(logit_cosine(rd.logits[0], full)))
    row["blocks1_agree"], row["blocks1_cosine"] = row["seam0_agree"], row["seam0_cosine"]
    row["edit_cost"] = {str(s): max(b - a for a, b in zip(_cuts(starts, s), _cuts(starts, s)[1:])) / mem
                        for s in p.blocks}
    controls = _control_names(p)
    if p.field_effect:
        row["toggled"] = _toggled_arms(ctx, inst, ids, r, (right, wrong), arms, full_ld, controls)
    if "no_rotation_far" in controls:
        row["far_distance"] = p.far_offset + starts[0]  # the memory lands this far from where it was precompiled
        row["far_check"] = far_check(arms["seam0_far"]["ld"], arms["seam0"]["ld"])
    row["graded"] = {"arms": arms}
    row["controls"] = {c: control_entry(t, row["toggled"]["arms"] if c == "stale" else arms, c)
                       for c, t in controls.items() if c != "stale" or "arms" in row.get("toggled", {})}
    if not row["controls"]:
        del row["controls"]
    if p.edit:
        base = states["seam1"] if "seam1" in states else _spliced(lm, ids, starts, r, seam=1, compiled=compiled)
        row["edit"] = _edit_row(ctx, inst, ids, r, base, full_ld)
    if p.e1_lines:
        row["e1"] = _e1_rows(ctx, inst, (ids, full_state))
    return row


def _toggled_arms(ctx: Context, inst: Any, ids: list[int], r: int, tokens: tuple[int, int],
                  arms: dict[str, dict[str, Any]], full_ld: float, controls: dict[str, str]) -> dict[str, Any]:
    """Every arm rebuilt on the memory with E3's relevant setting toggled, read in the original's orientation
    (the original's right minus wrong action); each arm's field effect retained is written into ``arms``. With
    the stale control, the old memory's full-recompute cache read for the toggled prompt (its LD is the old
    prompt's: retained 0)."""
    lm = ctx.lm
    new, n_ids, n_starts, _, _ = _toggled(ctx, inst)
    if n_ids[-r:] != ids[-r:] or answer_tokens(ctx, new, n_ids) != r:
        return {"skipped": "the toggled prompt ends in another answer prefix"}
    compiled: Compiled = {}
    states, extra = _arm_states(ctx, new, n_ids, n_starts, r, compiled)
    new_full = read_actions(lm, prefill(lm, n_ids[:-r]), n_ids[-r:], tokens).ld()
    out: dict[str, Any] = {"full_ld": new_full, "action": new.action}
    new_arms = {}
    for name, rd in read_named(lm, {**states, **extra}, n_ids[-r:], tokens, ctx.cfg.batch_size).items():
        ret = field_effect_retained(rd.ld(), arms[name]["ld"], new_full, full_ld)
        new_arms[name] = arm_entry(rd.ld(), new_full, ret, agree=(rd.ld() > 0) == (new_full > 0))
        if ret is not None:
            arms[name]["retained"] = ret
    if "stale" in controls:
        new_arms["stale"] = arm_entry(full_ld, new_full, field_effect_retained(full_ld, full_ld, new_full, full_ld),
                                      agree=(full_ld > 0) == (new_full > 0))
    out["arms"] = new_arms
    return out


def _e1_summary(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy per mode x placement x length, and the GEE-logistic tests (clusters: the lead setting)."""
    p = ctx.params
    cells = [(r["scenario"], c) for r in rows for c in r["e1"]]
    out: dict[str, Any] = {"lines": p.e1_lines, "placements": p.placements, "modes": p.modes,
                           "memory_tokens": {str(n): summarize([c["memory_tokens"] for _, c in cells
                                                                if c["lines"] == n and c["placement"] == "late"])
                                             for n in p.e1_lines},
                           "accuracy": {}, "gee_placement": {}, "gee_length": {}, "chain": {}}
    for mode in p.modes:
        sub = [(k, c) for k, c in cells if c["mode"] == mode]
        out["accuracy"][mode] = {pl: {str(n): summarize_proportion(
            [c["correct"] for _, c in sub if c["placement"] == pl and c["lines"] == n],
            [k for k, c in sub if c["placement"] == pl and c["lines"] == n]) for n in p.e1_lines}
            for pl in p.placements}
        if len(p.placements) == 2:  # beta_late: the log-odds of late against early, over every length
            out["gee_placement"][mode] = gee_binomial([c["correct"] for _, c in sub], [c["placement"] for _, c in sub],
                                                      [k for k, _ in sub], reference="early")
        if len(p.e1_lines) > 1:
            out["gee_length"][mode] = {pl: gee_binomial(
                [c["correct"] for _, c in sub if c["placement"] == pl],
                [f"{c['lines']:04d} lines" for _, c in sub if c["placement"] == pl],
                [k for k, c in sub if c["placement"] == pl], reference=f"{p.e1_lines[0]:04d} lines")
                for pl in p.placements}
        if mode == "chain":
            out["chain"] = {"decoding": "greedy", "chain_tokens": p.chain_tokens, "cue": p.cot_cue,
                            "answer_cue": "newline + " + ANSWER_PREFIX,
                            "decided_by_chain": sum(c["decided_by"] == "chain" for _, c in sub) / len(sub),
                            "mean_chain_tokens": sum(c["n_tokens"] for _, c in sub) / len(sub)}
    # per-instance measures for the claims: early and late correct at the longest length, per mode
    longest = p.e1_lines[-1]
    out["row_measures"] = {f"e1_{mode}": {"rows": {str(r["index"]): {
        f"{c['placement']}_correct": c["correct"] for c in r["e1"] if c["mode"] == mode and c["lines"] == longest}
        for r in rows}} for mode in p.modes}
    return out


def summarize_rows(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, Any]:
    p = ctx.params
    cl = [r["scenario"] for r in rows]
    variants = [f"seam{k}" for k in p.seam_repair] + ["no_rotation"]
    out: dict[str, Any] = {
        "n_instances": len(rows), "n_scenarios": len(set(cl)),
        "memory_tokens": summarize([r["memory_tokens"] for r in rows]),
        "label_balance": sum(r["action"] == "allow" for r in rows) / len(rows),
        "full_accuracy": summarize_proportion([r["full_correct"] for r in rows], cl),
        "transplant": {v: {"agreement": summarize_proportion([r[f"{v}_agree"] for r in rows], cl),
                           "cosine": summarize([r[f"{v}_cosine"] for r in rows], seed=ctx.cfg.seed, clusters=cl)}
                       for v in variants},
        "seam1_vs_no_rotation": mcnemar_exact([r.get("seam1_agree", r["seam0_agree"]) for r in rows],
                                              [r["no_rotation_agree"] for r in rows]),
        "granularity": {}}
    for layout in p.layouts:
        sub = [r for r in rows if r["layout"] == layout]
        if not sub:
            continue
        scl = [r["scenario"] for r in sub]
        out["granularity"][layout] = {str(s): {
            "agreement": summarize_proportion([r[f"blocks{s}_agree"] for r in sub], scl),
            "cosine": summarize([r[f"blocks{s}_cosine"] for r in sub], seed=ctx.cfg.seed, clusters=scl),
            "edit_cost": sum(r["edit_cost"][str(s)] for r in sub) / len(sub)} for s in p.blocks}
    edited = [r for r in rows if "edit" in r and "skipped" not in r["edit"]]
    if edited:
        ecl = [r["scenario"] for r in edited]
        out["edit"] = {
            "n": len(edited), "n_skipped": sum(1 for r in rows if "edit" in r) - len(edited), "modes": p.modes,
            "oracle_accuracy": {mode: summarize_proportion([r["edit"]["oracle"][mode] for r in edited], ecl)
                                for mode in p.modes},
            "irrelevant_toggle_kept": summarize_proportion([r["edit"]["irrelevant_toggle_kept"] for r in edited], ecl),
            "methods": {m: {"recompute_fraction": sum(r["edit"][m]["recompute_fraction"] for r in edited) / len(edited),
                            **{f"p_correct_{mode}": summarize_proportion([r["edit"][m][mode] for r in edited], ecl)
                               for mode in p.modes}} for m in EDITS},
            "erratum_vs_in_place": {mode: mcnemar_exact([r["edit"]["erratum"][mode] for r in edited],
                                                        [r["edit"]["in_place"][mode] for r in edited])
                                    for mode in p.modes}}
        for m in EDITS:  # the first mode's rate under the key older readers use
            out["edit"]["methods"][m]["p_correct"] = out["edit"]["methods"][m][f"p_correct_{p.modes[0]}"]
            for key in [f"ld_{mode}" for mode in p.modes] + ["retained"]:  # graded: LD (new - old action), retained
                vals = [r["edit"][m].get(key) for r in edited]
                if any(v is not None for v in vals):
                    out["edit"]["methods"][m][key] = summarize_column(edited, vals, ctx.cfg.seed)
    if p.e1_lines:
        out["e1"] = _e1_summary(ctx, rows)
        out["row_measures"] = out["e1"].pop("row_measures")
    out |= graded_summary(ctx, rows)
    return out


def graded_summary(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The graded block: each arm's LD, LD error and field effect retained; each must-fail control beside its
    treatment (cluster CIs by lead setting)."""
    seed, out = ctx.cfg.seed, {}
    if any("graded" in r for r in rows):
        out["graded"] = arms_summary([(r["scenario"], r["graded"]["arms"]) for r in rows if "graded" in r], seed)
    if any("controls" in r for r in rows):
        out["controls"] = controls_summary([(r["scenario"], r["controls"]) for r in rows if "controls" in r], seed)
        far = [r["far_distance"] for r in rows if "far_distance" in r]
        if far:
            out["far_distance_min"] = min(far)
            out["far_check_max"] = max(r["far_check"] for r in rows if "far_check" in r)
    return out


def _gee_cell(g: dict[str, Any], name: str) -> str:
    c = g["coefficients"].get(name)
    if c is None or not g["finite"]:
        return f"{name}: no finite fit (n {g['n']}, {g['n_clusters']} clusters)"
    return f"{name}: beta {c['beta']:+.2f} (SE {c['se']:.2f}, p {c['p']:.2g}; n {g['n']}, {g['n_clusters']} clusters)"


def informative_note(s: dict[str, Any]) -> str:
    """Which measures the model's own competence leaves informative (from the full-recompute accuracy)."""
    acc = s["full_accuracy"]
    if acc.get("ci_low") is not None and acc["ci_low"] > 0.5:
        return "the model decides the memory task above chance under full recompute: every measure is informative"
    return (f"full-recompute accuracy {acc['mean']:.2f} is not above chance: E1 accuracies and E3 P(correct) are "
            "uninformative here (the E3 claims count only instances the oracle decides correctly); E2/E4 "
            "agreement and cosine with full recompute need no competent model")


def table(s: dict[str, Any]) -> str:
    lines = [f"instances {s['n_instances']} ({s['n_scenarios']} lead settings, allow share {s['label_balance']:.2f}), "
             f"memory {s['memory_tokens']['mean']:.0f} tokens; full-recompute accuracy {ci_cell(s['full_accuracy'])}",
             informative_note(s)]
    if "e1" in s:
        e1 = s["e1"]
        toks = ", ".join(f"{n} lines ~{e1['memory_tokens'][str(n)]['mean']:.0f} tok" for n in e1["lines"])
        lines.append(f"E1 placement, full recompute (accuracy per memory length: {toks}):")
        for mode, by_pl in e1["accuracy"].items():
            for pl, by_n in by_pl.items():
                lines.append(f"  {mode:<7}{pl:<6}" + "  ".join(f"{ci_cell(b):<20}" for b in by_n.values()))
            if mode in e1["gee_placement"]:
                lines.append(f"    GEE placement ({mode}) " + _gee_cell(e1["gee_placement"][mode], "late"))
        if e1.get("chain"):
            c = e1["chain"]
            lines.append(f"  chain: greedy, {c['chain_tokens']} tokens max (mean {c['mean_chain_tokens']:.1f}), "
                         f"decided by the chain's words {100 * c['decided_by_chain']:.0f}%")
    lines.append("E2 transplant (late memory) vs full recompute:")
    lines += [f"  {v:<12} agree {ci_cell(b['agreement']):<22} cosine {ci_cell(b['cosine'], 4)}"
              for v, b in s["transplant"].items()]
    lines.append("E4 granularity (S blocks): agreement / cosine / edit cost")
    for layout, by_s in s["granularity"].items():
        lines.append(f"  {layout}: " + "; ".join(f"S={k} {b['agreement']['mean']:.2f} / {b['cosine']['mean']:.4f} / "
                                               f"{b['edit_cost']:.2f}" for k, b in by_s.items()))
    if "edit" in s:
        e = s["edit"]
        modes = e.get("modes", ["direct"])
        oracle = e["oracle_accuracy"]
        oracle = {"direct": oracle} if "mean" in oracle else oracle
        lines.append(f"E3 toggle one stored fact (n {e['n']}; oracle accuracy "
                     + ", ".join(f"{m} {ci_cell(oracle[m])}" for m in modes)
                     + f"; irrelevant toggle keeps the decision {ci_cell(e['irrelevant_toggle_kept'])}):")
        for m, b in e["methods"].items():
            lines.append(f"  {m:<14}" + "  ".join(f"{mode} {ci_cell(b.get(f'p_correct_{mode}', b['p_correct'])):<20}"
                                                  for mode in modes)
                         + f" recompute {100 * b['recompute_fraction']:.1f}%")
        mcs = e["erratum_vs_in_place"]
        mcs = {"direct": mcs} if "p" in mcs else mcs
        for mode, mc in mcs.items():
            lines.append(f"  McNemar erratum vs in_place ({mode}): {mc['a_only']} vs {mc['b_only']} discordant, "
                         f"p {mc['p']:.2g}")
        if any("retained" in b for b in e["methods"].values()):
            lines.append("  field effect retained (direct): " + "; ".join(
                f"{m} {ci_cell(b['retained'])}" for m, b in e["methods"].items() if "retained" in b))
    if "graded" in s or "controls" in s:
        lines.append("E2/E4 graded measures and must-fail controls (late memory, vs full recompute"
                     + (f"; no_rotation_far lands >= {s['far_distance_min']} positions from its precompile; the "
                        f"re-rotated splice moved there vs in place: max |dLD| {s['far_check_max']:.1e}, ~0 if exact"
                        if "far_distance_min" in s else "") + "):")
        lines += graded_lines(s.get("graded"), s.get("controls"))
    return "\n".join(lines)


def headline(s: dict[str, Any]) -> str:
    t = s["transplant"]
    cells = [f"{v} agree {b['agreement']['mean']:.2f} cos {b['cosine']['mean']:.3f}" for v, b in t.items()]
    if "edit" in s:
        cells.append("E3 P(correct) " + ", ".join(f"{m} {b['p_correct']['mean']:.2f}"
                                                  for m, b in s["edit"]["methods"].items()))
    if "e1" in s:
        e1, n = s["e1"], str(s["e1"]["lines"][-1])
        cells.append(f"E1 at {n} lines early/late " + ", ".join(
            f"{mode} " + "/".join(f"{e1['accuracy'][mode][pl][n]['mean']:.2f}" for pl in e1["placements"])
            for mode in e1["modes"]))
    if s.get("controls"):
        cells.append(controls_headline(s["controls"]))
    acc = s["full_accuracy"]
    chance = "" if acc.get("ci_low") is not None and acc["ci_low"] > 0.5 else " (at chance: E1/E3 uninformative)"
    return "; ".join(cells) + f"; full acc {acc['mean']:.2f}{chance}; n {s['n_instances']}"


EXPERIMENT = Experiment(
    section="sec7", section_order=1,
    name="memory", doc=__doc__, params=Params, make_instances=make_instances, run_instance=run_instance,
    summarize=summarize_rows, table=table, headline=headline,
    paper=paper_headlines("memory"),
    claims=(
        Claim("memory_transplant_agreement", "late memory transplant (1 seam token) decides as full recompute", "at_least", "seam1_agree", bound=1 - ACCURACY_MARGIN,
              gated=False, role="effect", competence=("full_correct",)),
        Claim("memory_no_rotation_control", "the rotated memory agrees with full recompute more than the unrotated", "greater", "seam1_agree", "no_rotation_agree",
              gated=False, role="control", competence=("full_correct",)),
        Claim("memory_blocks8_agreement", "memory in 8 independently precompiled blocks decides as full recompute", "at_least", "blocks8_agree",
              bound=1 - ACCURACY_MARGIN, gated=False, role="effect", competence=("full_correct",)),
        Claim("memory_blocks16_agreement", "memory in 16 independently precompiled blocks decides as full recompute", "at_least", "blocks16_agree",
              bound=1 - ACCURACY_MARGIN, gated=False, role="effect", competence=("full_correct",)),
        Claim("memory_erratum_vs_in_place", "erratum beats in_place on a toggled stored fact", "greater", "edit.erratum.correct", "edit.in_place.correct", gated=False, role="effect",
              only="edit.oracle_correct", competence=("full_correct",)),
        Claim("memory_erratum_vs_in_place_chain", "after a reasoning chain, erratum P(correct) minus in_place's on "
              "a toggled stored fact (described)", "describe",
              "edit.erratum.chain", "edit.in_place.chain", gated=False, role="effect", only="edit.oracle.chain", competence=("full_correct",)),
        Claim("memory_e1_late_cost_chain", "under a chain and full recompute, early minus late accuracy at the "
              "longest memory (described: ours is <= 2k tokens, where the paper's gap is ~0)",
              "describe", "e1_chain.early_correct", "e1_chain.late_correct", gated=False, role="effect", competence=("full_correct",)),
        Claim("memory_irrelevant_toggle", "toggling an irrelevant setting keeps the full-recompute decision", "at_least", "edit.irrelevant_toggle_kept",
              bound=1 - ACCURACY_MARGIN, gated=False, role="control", competence=("full_correct",)),
        # Must-fail controls beside their treatment, graded (LD nats; no competent model needed), each by a margin of
        # kvprobe's own (SEPARATION_MARGIN, RETAINED_MARGIN in kvprobe.claims): rows of records run with the control.
        Claim("memory_far_rotation_separation", "the late memory spliced without re-rotation >= 2,000 positions "
              "from its precompile is further from full recompute's LD than the re-rotated splice there, by more "
              f"than kvprobe's margin ({SEPARATION_MARGIN} nats)", "greater", "controls.no_rotation_far.separation",
              SEPARATION_MARGIN, gated=False, role="control"),
        Claim("memory_wrong_memory_separation", "another user's memory spliced in place is further from full "
              f"recompute's LD than the right memory's splice, by more than kvprobe's margin ({SEPARATION_MARGIN} "
              "nats)", "greater", "controls.wrong_memory.separation", SEPARATION_MARGIN, gated=False, role="control"),
        Claim("memory_stale_retained_separation", "the spliced memory retains more of full recompute's response "
              "to a toggled stored fact than a stale cache (retained 0), by more than kvprobe's margin "
              f"({RETAINED_MARGIN})", "greater", "controls.stale.retained_separation", RETAINED_MARGIN, gated=False,
              role="control"),
    ))
