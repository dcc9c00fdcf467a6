"""Rows and summaries the editing experiments share (paper Section 4, Appendix E).

A method's entry in a row: its action logit difference (new-correct minus old-correct action), whether its
decision is correct (argmax of the two action tokens is the new value's action, i.e. ld > 0), its recovery
between the instance's stale and oracle anchors, its exact recompute counts, and, where the method reads a
prompt other than the original (erratum, hoist), its agreement with a full reprefill of that same text.

For an erratum over the stale cache that agreement is an identity, not a finding: the stale cache is the
prefill of the old text, so appending the erratum is the prefill of the erratum text (up to float error;
``tests/test_edit.py``). It is a check. For field+erratum (the field recomputed in place, the downstream
left stale) and for hoist-to-end it is a measurement.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvprobe.backends import HookableModel
from kvprobe.kv.edit import FieldEdit
from kvprobe.kv.readout import read_logits
from kvprobe.metrics import logit_diff
from kvprobe.patching.pairs import Anchors, PairPrefill, measure, prefill_pair
from kvprobe.probes.summary import ci_cell, gate_summary, scenarios, which
from kvprobe.stats.bootstrap import summarize
from kvprobe.stats.inference import summarize_proportion
from kvprobe.tasks.gated import TokenizedPair, tokenize_pair


@dataclass(frozen=True)
class EditCase:
    """One instance ready to edit: its token pair, both prefills, the edit and the stale/oracle anchors."""

    pair: TokenizedPair
    pp: PairPrefill
    edit: FieldEdit
    anchor: Anchors
    readout_tokens: int


def edit_case(ctx: Any, inst: Any, readout_tokens: int) -> EditCase:
    lm = ctx.lm
    pair = tokenize_pair(lm.tokenizer, inst, lm.has_chat_template)
    pp = prefill_pair(lm, pair, readout_tokens)
    anchor, _, _ = measure(lm, pp, {}, ctx.cfg.batch_size)
    return EditCase(pair, pp, FieldEdit.from_pair(pp), anchor, readout_tokens)


def base_row(ctx: Any, inst: Any, case: EditCase) -> dict[str, Any]:
    """What every edit row starts with: the instance, its size, the anchors and whether it passed the gate."""
    return {**inst.row(), "n_tokens": len(case.pair), "field_slots": case.pair.field_slots, **case.anchor.row(),
            "included": case.anchor.gate(ctx.cfg.gate.min_flip, ctx.cfg.gate.require_oracle_correct)}


def read_ld(lm: HookableModel, pair: Any, state: Any, suffix: Sequence[int]) -> float:
    """Action logit difference of one state (new-correct minus old-correct action)."""
    return float(logit_diff(read_logits(lm, state, list(suffix)), pair.new_action_id, pair.old_action_id)[0])


def method_entry(anchor: Any, ld: float, result: Any = None, reference_ld: float | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"ld": ld, "correct": ld > 0, "recovery": float(anchor.recovery(ld))}
    if result is not None:
        entry.update(result.row())
    if reference_ld is not None:
        entry["reference_ld"] = reference_ld
        entry["agrees_with_reference"] = (ld > 0) == (reference_ld > 0)
    return entry


def _mean(values: Sequence[float]) -> float | None:
    vals = [float(v) for v in values]
    return sum(vals) / len(vals) if vals else None


def methods_summary(rows: Sequence[dict[str, Any]], names: Sequence[str], seed: int = 0,
                    key: str = "methods") -> dict[str, Any]:
    """Per method: P(correct) with its exact (Clopper-Pearson) interval and recovery with a cluster-bootstrap
    CI by scenario, over gated and over all instances; mean recompute fraction, whether it needs prompt
    surgery, and agreement with its own full reprefill where measured."""
    out: dict[str, Any] = {}
    gated = [r for r in rows if r["included"]]
    for name in names:
        def col(rs, field, name=name):
            return [r[key][name][field] for r in rs if name in r[key] and field in r[key][name]]

        def has(rs, field, name=name):
            return [r for r in rs if name in r[key] and field in r[key][name]]

        block: dict[str, Any] = {
            "p_correct": {w: summarize_proportion([bool(v) for v in col(rs, "correct")], scenarios(has(rs, "correct")))
                          for w, rs in (("gated", gated), ("all", rows))},
            "recovery": {w: summarize(col(rs, "recovery"), seed=seed, clusters=scenarios(has(rs, "recovery")))
                         for w, rs in (("gated", gated), ("all", rows))},
        }
        if col(rows, "recompute_fraction"):
            block["recompute_fraction"] = _mean(col(rows, "recompute_fraction"))
            block["needs_prompt_surgery"] = any(col(rows, "needs_prompt_surgery"))
        if col(rows, "agrees_with_reference"):
            block["agreement_with_reference"] = _mean([float(v) for v in col(rows, "agrees_with_reference")])
            block["agreement_with_reference_ci"] = summarize_proportion(
                [bool(v) for v in col(rows, "agrees_with_reference")], scenarios(has(rows, "agrees_with_reference")))
        out[name] = block
    return out


def edit_gate_summary(ctx: Any, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The gate block plus the effect size every edit record carries: the oracle flip (nats) with a CI."""
    out = gate_summary(rows, ctx.cfg.gate)
    gated = [r for r in rows if r["included"]]
    out["effect_size"] = {"oracle_flip_nats": summarize([r["flip"] for r in rows], seed=ctx.cfg.seed,
                                                        clusters=scenarios(rows)),
                          "oracle_flip_nats_gated": summarize([r["flip"] for r in gated], seed=ctx.cfg.seed,
                                                              clusters=scenarios(gated))}
    out["summary_over"] = "gated" if out["n_included"] else "all (no instance passed the gate)"
    return out


def methods_headline(summary: dict[str, Any], names: Sequence[str] | None = None) -> str:
    """``method P(correct) [CI] @ recompute%; ...`` over gated instances (else all, and it says so)."""
    w = which(summary)
    cells = []
    for name in names or list(summary["methods"]):
        b = summary["methods"].get(name)
        if b is None or not b["p_correct"][w].get("n"):
            continue
        frac = b.get("recompute_fraction")
        cells.append(f"{name} {ci_cell(b['p_correct'][w])}" + ("" if frac is None else f" @{100 * frac:.1f}%"))
    return "P(correct): " + "; ".join(cells) + ("" if w == "gated" else " (all instances: none gated)")


def reference_is_identity(method: str) -> bool:
    """Whether a method's agreement with the reprefill of its own text holds by construction (an erratum
    appended to the stale cache, in any wording)."""
    return method == "erratum" or method.startswith("erratum/")


def format_methods_table(summary: dict[str, Any], names: Sequence[str], key: str = "methods") -> str:
    over = which(summary)
    g = summary["gate"]
    w = max([len(n) for n in names] + [20]) + 2
    lines = [f"instances {summary['n_instances']}, included {summary['n_included']} (inclusion rule: oracle flip >= "
             f"{g['min_flip']} nats); oracle flip median {summary['oracle_flip'].get('median', float('nan')):.3f}; "
             f"columns over {over} instances",
             f"{'method':<{w}}{'P(correct)':<22}{'recovery':<24}{'recompute':>10}  surgery  vs-reprefill"]
    for name in names:
        b = summary[key][name]
        frac = b.get("recompute_fraction")
        agree = b.get("agreement_with_reference")
        lines.append(f"{name:<{w}}{ci_cell(b['p_correct'][over]):<22}{ci_cell(b['recovery'][over]):<24}"
                     f"{'' if frac is None else f'{100 * frac:.1f}%':>10}  "
                     f"{'yes' if b.get('needs_prompt_surgery') else 'no':<8} "
                     f"{'' if agree is None else f'{agree:.2f}'}"
                     f"{' (identity)' if agree is not None and reference_is_identity(name) else ''}")
    if any(summary[key][n].get("agreement_with_reference") is not None and reference_is_identity(n) for n in names):
        lines.append("(identity: an erratum over the stale cache is the prefill of the same text, a check, not a finding)")
    return "\n".join(lines)
