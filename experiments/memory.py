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
  crossed with the label (instance i takes ``layouts[(i // 2) % n]``, the label alternates with i); the edit
  cost per S is one block's tokens over the memory's.
- E3 edit: one relevant stored fact toggled (the decision flips) over the spliced (seam 1) cache: stale,
  in_place (the value's tokens recomputed), erratum (a ``[MEMORY UPDATE]`` line appended after the memory,
  the cache reused up to it) and field+erratum, each read directly and after the chain (``modes``);
  P(correct) is the rate of the new decision; McNemar erratum vs in_place per mode. The negative control
  toggles an irrelevant setting: under full recompute the decision must not move.

Direct decisions are the argmax of the two action tokens (`` allow`` / `` refuse``) after ``Decision:``; every
cache ends where that answer prefix begins, so a chain can start there. Where our setting differs: small CPU
models (a 135M model decides an AND over two settings near chance, which the record's full-recompute
accuracy shows), instruction-tuned rather than reasoning-native (the chain is induced by a cue and short),
and memories of ~0.4k to ~1k tokens rather than 2k to 32k (the record states the lengths).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvprobe.backends import HookableModel
from kvprobe.claims import ACCURACY_MARGIN, Claim
from kvprobe.kv import edit
from kvprobe.kv.compose import Live, Spliced, assemble, precompile
from kvprobe.kv.edit import FieldEdit
from kvprobe.kv.readout import prefill, read_logits
from kvprobe.metrics import logit_cosine
from kvprobe.probes.chain import chain_decision
from kvprobe.probes.summary import ci_cell
from kvprobe.runner.experiment import Context, Experiment
from kvprobe.stats.bootstrap import summarize
from kvprobe.stats.inference import gee_binomial, mcnemar_exact, summarize_proportion
from kvprobe.tasks.gated import render
from kvprobe.tasks.memory import ANSWER_PREFIX, PLACEMENTS, VALUES, action_ids, persona_instance, render_ids
from kvprobe.paper import headlines as paper_headlines
from kvprobe.schema import distinct_subset

EDITS = ("stale", "in_place", "erratum", "field_erratum")
MODES = ("direct", "chain")


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    n_lines: int = Field(40, ge=10, description="memory lines (8 settings + filler notes); ~12 tokens a line")
    n_relevant: int = Field(2, ge=1, le=4, description="settings the request ANDs over")
    seam_repair: list[int] = Field(default_factory=lambda: [0, 1])
    blocks: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16], description="E4: numbers of blocks S")
    layouts: list[str] = Field(default_factory=lambda: ["contiguous", "split"],
                               description="relevant facts contiguous or split, crossed with the label (which "
                                           "alternates with i): instance i takes layouts[(i // 2) % n]")
    edit: bool = Field(True, description="run E3 (toggle one stored fact)")
    modes: list[str] = Field(default_factory=lambda: ["direct", "chain"],
                             description="E1 and E3: decide directly and/or after a greedy chain")
    chain_tokens: int = Field(12, ge=1, le=512, description="greedy chain budget (tokens); short on a CPU")
    cot_cue: str = Field("Let me check each required setting in the user memory.",
                         description="run over the cache before the chain")
    e1_lines: list[int] = Field(default_factory=lambda: [40, 100],
                                description="E1: memory lines per length (~12 tokens a line); [] skips E1")
    placements: list[str] = Field(default_factory=lambda: ["early", "late"], description="E1 placements")

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
                             layout=p.layouts[(i // 2) % len(p.layouts)]) for i in range(ctx.cfg.task.n_instances)]


def _cuts(starts: list[int], s: int) -> list[int]:
    n = len(starts) - 1
    return sorted({starts[round(i * n / s)] for i in range(s + 1)})


def _spliced(lm: HookableModel, ids: list[int], starts: list[int], r: int, s: int = 1, seam: int = 0,
             rotate: bool = True, compiled: dict[tuple[int, int], Any] | None = None) -> Any:
    """The memory cut into ``s`` blocks at line boundaries, each precompiled alone and spliced between the live
    head and the live tail; the cache ends ``r`` tokens (the answer prefix) before the prompt's end.
    ``compiled`` keeps each block's isolated cache across calls (a block is precompiled once per instance)."""
    m0, m1 = starts[0], starts[-1]
    cuts = _cuts(starts, s)
    compiled = {} if compiled is None else compiled
    for x, y in zip(cuts, cuts[1:]):
        if (x, y) not in compiled:
            compiled[(x, y)] = precompile(lm, ids[x:y])
    blocks = [Spliced(tuple(ids[x:y]), compiled[(x, y)], seam=seam if i == 0 else 0, rotate=rotate)
              for i, (x, y) in enumerate(zip(cuts, cuts[1:]))]
    return assemble(lm, [Live(tuple(ids[:m0])), *blocks, Live(tuple(ids[m1:-r]))])


def answer_tokens(ctx: Context, inst: Any, ids: list[int]) -> int:
    """How many final prompt tokens the answer prefix takes (the cache ends before them)."""
    tok = ctx.lm.tokenizer
    text, special = render(tok, inst.body(), ctx.lm.has_chat_template)
    head = tok(text, add_special_tokens=special)["input_ids"]
    shared = next((i for i, (x, y) in enumerate(zip(ids, head)) if x != y), min(len(ids), len(head)))
    return len(ids) - shared


def _decide(ctx: Context, mode: str, state: Any, suffix: list[int], actions: tuple[str, str],
            tokens: tuple[int, int]) -> dict[str, Any]:
    """The decision over ``state`` (a cache ending where the answer prefix ``suffix`` begins): direct, the
    argmax of the two action tokens after the prefix; chain, after a bounded greedy chain."""
    lm, p = ctx.lm, ctx.params
    if mode == "direct":
        lg = read_logits(lm, state, suffix)[0]
        return {"decision": actions[0] if lg[tokens[0]] > lg[tokens[1]] else actions[1]}
    cue = ctx.lm.tokenizer(p.cot_cue, add_special_tokens=False)["input_ids"]
    answer = ctx.lm.tokenizer("\n" + ANSWER_PREFIX, add_special_tokens=False)["input_ids"]
    out = chain_decision(lm, state, cue, answer, p.chain_tokens, actions, tokens)
    return {k: out[k] for k in ("decision", "decided_by", "n_tokens", "text")}


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


def _edit_row(ctx: Context, inst: Any, ids: list[int], r: int, base: Any, full_old: Any) -> dict[str, Any]:
    """E3: toggle one relevant fact over the spliced cache ``base`` of the old memory; every method read in
    every mode. ``full_old``: the full-recompute logits of the old prompt."""
    lm, tok, chat, p = ctx.lm, ctx.lm.tokenizer, ctx.lm.has_chat_template, ctx.params
    old_v = inst.value_of(inst.toggle)
    new_v = VALUES[1 - VALUES.index(old_v)]
    new = inst.with_value(inst.toggle, new_v)
    new_ids, _, new_prompt, special = render_ids(tok, new, chat)
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
            if mode == "chain":
                row[name]["chain_decided_by"] = d["decided_by"]
        row[name]["correct"] = row[name][p.modes[0]]
    oracle = prefill(lm, new_ids[:-r])
    row["oracle"] = {mode: _decide(ctx, mode, oracle, new_ids[-r:], acts, tokens)["decision"] == new.action
                     for mode in p.modes}
    row["oracle_correct"] = row["oracle"][p.modes[0]]
    # negative control: an irrelevant setting toggled; under full recompute the decision must stay
    irr = inst.with_value(inst.irrelevant, VALUES[1 - VALUES.index(inst.value_of(inst.irrelevant))])
    irr_ids, _, _, _ = render_ids(tok, irr, chat)
    right, wrong = tokens[1], tokens[0]  # the old action's token first: the decision before the toggle
    full_irr = read_logits(lm, prefill(lm, irr_ids[:-r]), irr_ids[-r:])[0]
    row["irrelevant_toggle_kept"] = bool((full_old[right] > full_old[wrong]) == (full_irr[right] > full_irr[wrong]))
    return row


def run_instance(ctx: Context, inst: Any) -> dict[str, Any]:
    lm, tok, p = ctx.lm, ctx.lm.tokenizer, ctx.params
    ids, starts, prompt, special = render_ids(tok, inst, lm.has_chat_template)
    r = answer_tokens(ctx, inst, ids)
    right, wrong = action_ids(tok, prompt, ids, special, (inst.action, inst.other_action))
    full_state = prefill(lm, ids[:-r])
    full = read_logits(lm, full_state, ids[-r:])[0]
    full_right = bool(full[right] > full[wrong])
    compiled: dict[tuple[int, int], Any] = {}
    states = {f"seam{k}": _spliced(lm, ids, starts, r, seam=k, compiled=compiled) for k in p.seam_repair}
    states["no_rotation"] = _spliced(lm, ids, starts, r, rotate=False, compiled=compiled)
    states |= {f"blocks{s}": _spliced(lm, ids, starts, r, s, compiled=compiled) for s in p.blocks if s > 1}
    logits = read_logits(lm, list(states.values()), ids[-r:], batch_size=ctx.cfg.batch_size)
    mem = starts[-1] - starts[0]
    row: dict[str, Any] = {**inst.row(), "included": True, "n_tokens": len(ids), "memory_tokens": mem,
                           "answer_prefix_tokens": r, "full_correct": full_right,
                           "full_ld": float(full[right] - full[wrong])}
    for i, name in enumerate(states):
        row[f"{name}_agree"] = bool(logits[i, right] > logits[i, wrong]) == full_right
        row[f"{name}_cosine"] = float(logit_cosine(logits[i], full))
    row["blocks1_agree"], row["blocks1_cosine"] = row["seam0_agree"], row["seam0_cosine"]
    row["edit_cost"] = {str(s): max(b - a for a, b in zip(_cuts(starts, s), _cuts(starts, s)[1:])) / mem
                        for s in p.blocks}
    if p.edit:
        base = states["seam1"] if "seam1" in states else _spliced(lm, ids, starts, r, seam=1, compiled=compiled)
        row["edit"] = _edit_row(ctx, inst, ids, r, base, full)
    if p.e1_lines:
        row["e1"] = _e1_rows(ctx, inst, (ids, full_state))
    return row


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
    if p.e1_lines:
        out["e1"] = _e1_summary(ctx, rows)
        out["row_measures"] = out["e1"].pop("row_measures")
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
    ))
