"""Two-hop facts split across independently precompiled blocks (paper Appendix G, Section 7 E4).

A user memory holds a DEFINITION line A naming which setting governs the request, and that setting's value B
a few lines later; the other settings take both values, so the decision (allow if the governing setting is
enabled, refuse if disabled) needs the chain A -> B (:func:`kvprobe.tasks.memory.twohop_instance`). The
memory is cut into two blocks, each precompiled alone and spliced (re-rotated) between the live preamble and
the live request: SPLIT puts the boundary between A and B (B's block never attended to A), TOGETHER moves it
just past B (A and B in one block), everything else fixed; ONE_BLOCK precompiles the whole memory as one
block. Each layout's decision (the argmax of the two action tokens) is compared with a full recompute of
the same tokens; McNemar (exact) on the discordant pairs tests TOGETHER > SPLIT.

The control is an independent pair split the same way: the same user, layout and boundary, with A replaced
by an unrelated note and the request naming its setting, so the decision needs B alone.

The full-recompute accuracy comes first: the paper's comparison needs a model that performs the two-hop
decision (Llama-3.1-8B: 0.85). Where the exact 95% interval of our full-recompute accuracy does not lie
above 0.5, the record says the comparison is uninformative and the claims count no instance (each row of
``summary.row_measures.informative`` carries ``model_decides`` false, and the claims read only rows where it
is true), so no verdict is drawn; the measures stay in the record for reading.

Where our setting differs: small CPU models, a raw (non-chat) prompt of ~300 tokens, and two blocks.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvprobe.backends import HookableModel
from kvprobe.claims import Claim
from kvprobe.kv.compose import Live, Spliced, assemble, precompile
from kvprobe.kv.readout import prefill, read_logits
from kvprobe.metrics import logit_cosine
from kvprobe.probes.summary import ci_cell
from kvprobe.runner.experiment import Context, Experiment
from kvprobe.stats.inference import mcnemar_exact, summarize_proportion
from kvprobe.tasks.memory import action_ids, render_ids, twohop_instance
from kvprobe.paper import headlines as paper_headlines

CONDITIONS = ("twohop", "independent")
LAYOUTS = ("split", "together", "one_block")


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    n_lines: int = Field(14, ge=9, description="memory lines per user")
    gap: int = Field(3, ge=1, description="lines from A to B")


def make_instances(ctx: Context) -> list[Any]:
    p = ctx.params
    return [twohop_instance(i, ctx.cfg.seed, "twohop", p.n_lines, p.gap) for i in range(ctx.cfg.task.n_instances)]


def _layouts(lm: HookableModel, ids: list[int], starts: list[int], b: int) -> dict[str, Any]:
    m0, m1 = starts[0], starts[-1]
    head, tail = Live(tuple(ids[:m0])), Live(tuple(ids[m1:-1]))

    def blocks(cuts: list[int]) -> list[Spliced]:
        return [Spliced(tuple(ids[x:y]), precompile(lm, ids[x:y])) for x, y in zip(cuts, cuts[1:])]

    return {"split": assemble(lm, [head, *blocks([m0, starts[b], m1]), tail]),
            "together": assemble(lm, [head, *blocks([m0, starts[b + 1], m1]), tail]),
            "one_block": assemble(lm, [head, *blocks([m0, m1]), tail])}


def _condition_row(ctx: Context, inst: Any) -> dict[str, Any]:
    lm, tok = ctx.lm, ctx.lm.tokenizer
    ids, starts, prompt, special = render_ids(tok, inst, lm.has_chat_template)
    right, wrong = action_ids(tok, prompt, ids, special, (inst.action, inst.other_action))
    full = read_logits(lm, prefill(lm, ids[:-1]), ids[-1:])[0]
    states = _layouts(lm, ids, starts, inst.marks["b"])
    logits = read_logits(lm, list(states.values()), ids[-1:], batch_size=ctx.cfg.batch_size)
    full_right = bool(full[right] > full[wrong])
    row: dict[str, Any] = {"full_correct": full_right, "full_ld": float(full[right] - full[wrong]),
                           "n_tokens": len(ids), "boundaries": {"split": starts[inst.marks["b"]],
                                                                "together": starts[inst.marks["b"] + 1]}}
    for i, name in enumerate(states):
        row[f"{name}_agree"] = bool(logits[i, right] > logits[i, wrong]) == full_right
        row[f"{name}_cosine"] = float(logit_cosine(logits[i], full))
    return row


def run_instance(ctx: Context, inst: Any) -> dict[str, Any]:
    control = twohop_instance(inst.index, ctx.cfg.seed, "independent", ctx.params.n_lines, ctx.params.gap)
    return {**inst.row(), "included": True, "twohop": _condition_row(ctx, inst),
            "independent": _condition_row(ctx, control)}


def summarize_rows(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, Any]:
    clusters = [r["scenario"] for r in rows]
    out: dict[str, Any] = {"n_instances": len(rows), "n_scenarios": len(set(clusters)),
                           "label_balance": sum(r["action"] == "allow" for r in rows) / len(rows)}
    for cond in CONDITIONS:
        block: dict[str, Any] = {
            "full_accuracy": summarize_proportion([r[cond]["full_correct"] for r in rows], clusters),
            **{f"{lay}_agreement": summarize_proportion([r[cond][f"{lay}_agree"] for r in rows], clusters)
               for lay in LAYOUTS},
            **{f"{lay}_cosine_mean": sum(r[cond][f"{lay}_cosine"] for r in rows) / len(rows) for lay in LAYOUTS}}
        mc = mcnemar_exact([r[cond]["together_agree"] for r in rows], [r[cond]["split_agree"] for r in rows])
        block["together_vs_split"] = {**mc, "penalty": block["together_agreement"]["mean"]
                                      - block["split_agreement"]["mean"]}
        out[cond] = block
    acc = out["twohop"]["full_accuracy"]
    out["informative"] = bool(acc.get("ci_low") is not None and acc["ci_low"] > 0.5)
    out["verdict_note"] = ("the model performs the two-hop decision above chance under full recompute: the "
                           "split/together comparison is informative" if out["informative"] else
                           f"full-recompute two-hop accuracy {acc['mean']:.2f} [{acc['ci_low']:.2f}, "
                           f"{acc['ci_high']:.2f}] is not above chance: the model cannot do the two-hop decision, "
                           "so the split/together comparison is uninformative and no verdict is drawn")
    measures = {str(r["index"]): {"model_decides": out["informative"],
                                  "together_agree": r["twohop"]["together_agree"],
                                  "split_agree": r["twohop"]["split_agree"],
                                  "control_together_agree": r["independent"]["together_agree"],
                                  "control_split_agree": r["independent"]["split_agree"]} for r in rows}
    out["row_measures"] = {"informative": {"rows": measures}}
    return out


def table(s: dict[str, Any]) -> str:
    lines = [f"instances {s['n_instances']} ({s['n_scenarios']} governing settings; allow share "
             f"{s['label_balance']:.2f}); {s['verdict_note']}",
             f"{'condition':<13}{'full acc':<22}{'split agree':<22}{'together agree':<22}{'one block':<22}"
             "McNemar together>split"]
    for cond in CONDITIONS:
        b = s[cond]
        mc = b["together_vs_split"]
        lines.append(f"{cond:<13}{ci_cell(b['full_accuracy']):<22}{ci_cell(b['split_agreement']):<22}"
                     f"{ci_cell(b['together_agreement']):<22}{ci_cell(b['one_block_agreement']):<22}"
                     f"penalty {mc['penalty']:+.2f} ({mc['a_only']} vs {mc['b_only']} discordant, p {mc['p']:.2g})")
    return "\n".join(lines)


def headline(s: dict[str, Any]) -> str:
    t, c = s["twohop"], s["independent"]
    return (f"full-recompute two-hop acc {t['full_accuracy']['mean']:.2f}; agreement split "
            f"{t['split_agreement']['mean']:.2f} vs together {t['together_agreement']['mean']:.2f} (penalty "
            f"{t['together_vs_split']['penalty']:+.2f}, McNemar p {t['together_vs_split']['p']:.2g}); control "
            f"penalty {c['together_vs_split']['penalty']:+.2f}; n {s['n_instances']}"
            + ("" if s["informative"] else "; uninformative (model at chance on the two-hop decision)"))


EXPERIMENT = Experiment(
    section="appG",
    name="twohop_blocks", doc=__doc__, params=Params, make_instances=make_instances, run_instance=run_instance,
    summarize=summarize_rows, table=table, headline=headline,
    paper=paper_headlines("twohop_blocks"),
    claims=(
        Claim("twohop_split_penalty", "splitting a two-hop pair across blocks lowers agreement with full recompute", "greater", "informative.together_agree",
              "informative.split_agree", gated=False, role="effect",
              only="informative.model_decides", competence=("twohop.full_correct",)),
        Claim("independent_split_free", "splitting an independent pair the same way costs ~nothing", "equivalent", "informative.control_together_agree",
              "informative.control_split_agree", bounds=(-0.1, 0.1), gated=False, role="control",
              only="informative.model_decides", competence=("independent.full_correct",)),
    ))
