"""Figure 3a: field-only recovery with the rule before vs after the field, per model (the principal finding), and
Appendix C's off-template shapes.

Bars use the included instances. In Appendix C a shape with no included instance is drawn hatched from all
instances and labelled so, because a recovery over near-zero oracle flips is a ratio of noise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import bar_with_ci, legend_below, save, short_model, tagged, task_label, task_template
from kvprobe.paper import paper_value

STATES = ("stale", "field_only", "full_downstream", "oracle")
COLORS = {"stale": "#9e9e9e", "field_only": "#e07b39", "full_downstream": "#3a78b5", "oracle": "#2e7d32"}
YLIM = (-0.5, 1.5)


# Fig. 3a draws the principal finding: field-only recovery with the rule before vs after the field. Its sources,
# best first: locality_distance runs that move only the rule within one format (the organisms' rule_position task,
# the pretrained models' sizes task), then a locality record whose rows carry their rule position (generated
# instances) or whose template puts the rule after the field (the paper's gated / polarity templates).
RULE_SOURCES = {"rule_position": 0, "sizes": 1, "sizes_150": 2}
RULE_AFTER_TEMPLATES = ("gated", "polarity", "polarity_wide")
POSITIONS = {"before_field": ("rule before the field", "#3a78b5"), "after_field": ("rule after the field", "#e07b39")}
MAX_PER_PANEL = 4


def rule_rows(record: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """A record's rows by the rule's position relative to the field (rows whose position is unknown: none)."""
    generated = bool(record["config"]["task"].get("generator"))
    default = "after_field" if not generated and Path(task_template(record)).stem in RULE_AFTER_TEMPLATES else None
    out: dict[str, list[dict[str, Any]]] = {pos: [] for pos in POSITIONS}
    for row in record.get("rows", []):
        pos = row.get("rule_at") or default
        if pos in out:
            out[pos].append(row)
    return out


def rule_split(records: list[dict[str, Any]]) -> dict[str, dict[str, tuple[dict[str, Any], list[dict[str, Any]]]]]:
    """Per model and rule position, the record that best shows it (see RULE_SOURCES) and its rows there. One
    record that moves only the rule serves both positions; failing one, each position takes its own best record
    (e.g. the template for 'after', generated system_user instances for 'before'). A bar never pools records."""
    candidates: dict[str, list[tuple[int, int, dict[str, Any], dict[str, list[dict[str, Any]]]]]] = {}
    for order, rec in enumerate(tagged(records)):
        if rec["experiment"] == "locality_distance" and rec["_task"] in RULE_SOURCES:
            rank = RULE_SOURCES[rec["_task"]]
        elif rec["experiment"] == "locality":
            rank = 10
        else:
            continue
        split = rule_rows(rec)
        if any(split.values()):
            candidates.setdefault(rec["model"]["name"], []).append((rank - (5 if all(split.values()) else 0), order,
                                                                     rec, split))
    out: dict[str, dict[str, tuple[dict[str, Any], list[dict[str, Any]]]]] = {}
    for model, cands in candidates.items():
        cands.sort(key=lambda c: c[:2])
        out[model] = {}
        for pos in POSITIONS:
            best = next((c for c in cands if c[3][pos]), None)
            if best is not None:
                out[model][pos] = (best[2], best[3][pos])
    return out


def _source_label(by_position: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]]) -> str:
    """The prompt shape each bar of a model comes from: once when one record serves both positions."""
    def shape(record: dict[str, Any], rows: list[dict[str, Any]]) -> str:
        names = {"user_turn": "user turn", "document_qa": "doc. QA", "system_user": "system+user",
                 "tool_call": "tool call"}
        formats = sorted({r["format"] for r in rows if r.get("format")})
        distances = sorted({int(r["distance_target"]) for r in rows if r.get("distance_target")})
        text = " + ".join(names.get(f, f.replace("_", " ")) for f in formats) if formats else task_label(record)
        return text + (f"\n{'/'.join(map(str, distances))} tok" if distances else "")

    records = {id(rec) for rec, _ in by_position.values()}
    if len(records) == 1:
        rec = next(iter(by_position.values()))[0]
        return shape(rec, [r for _, rows in by_position.values() for r in rows])
    return "\n".join(f"{pos.split('_')[0]}: {shape(rec, rows)}" for pos, (rec, rows) in by_position.items())


def _panels(models: list[str]) -> list[tuple[str, list[str]]]:
    """Models in panels of at most MAX_PER_PANEL: pretrained and organisms apart where the study says which."""
    from kvprobe.study import load_study, study_present

    kinds = {m: e.kind for m, e in load_study().models.items()} if study_present() else {}
    groups: dict[str, list[str]] = {}
    for m in models:
        groups.setdefault({"pretrained": "pretrained models", "organism": "organisms"}.get(kinds.get(m, ""), "models"),
                          []).append(m)
    return [(title if len(ms) <= MAX_PER_PANEL else f"{title} ({i // MAX_PER_PANEL + 1})", ms[i:i + MAX_PER_PANEL])
            for title, ms in groups.items() for i in range(0, len(ms), MAX_PER_PANEL)]


def fig3a_locality(records: list[dict[str, Any]], path: Path) -> None:
    """Finding 1: refreshing only the field's cache entries recovers the decision where the rule comes before the
    field, and almost nothing where it comes after (the paper's template). Per model two bars, field-only recovery
    over the included instances with 95% cluster-bootstrap CIs; the identities (stale 0, full-downstream and
    oracle 1 by construction) are not drawn. A position with no included instance says so instead of a bar."""
    from kvprobe.probes.summary import summarize_column

    per_model = rule_split(records)
    if not per_model:
        return
    panels = _panels(list(per_model))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5, 3.6), squeeze=False,
                             gridspec_kw={"width_ratios": [max(2, len(ms)) for _, ms in panels]}, sharey=True)
    width = 0.36
    labelled: set[str] = set()
    for ax, (title, models) in zip(axes[0], panels):
        labels = []
        for m, name in enumerate(models):
            by_position = per_model[name]
            for p, (pos, (label, color)) in enumerate(POSITIONS.items()):
                x = m + (p - 0.5) * width
                rows = by_position[pos][1] if pos in by_position else []
                included = [r for r in rows if r.get("included")]
                if not rows:
                    ax.text(x, 0.02, "no run", ha="center", va="bottom", fontsize=5, rotation=90, color="#777777")
                    continue
                if not included:
                    ax.text(x, 0.02, f"0/{len(rows)} incl.", ha="center", va="bottom", fontsize=5, rotation=90,
                            color=color)
                    continue
                stat = summarize_column(included, [r.get("field_only") for r in included], seed=0)
                bar_with_ci(ax, x, stat, width, color, label=None if pos in labelled else label)
                labelled.add(pos)
                top = stat["mean"] if stat.get("ci_high") is None else max(stat["ci_high"], stat["mean"])
                ax.text(x, max(top, 0) + 0.03, f"{len(included)}/{len(rows)}", ha="center", va="bottom", fontsize=5)
            labels.append(f"{short_model(name).replace(' org. ', chr(10) + 'org. ')}\n{_source_label(by_position)}")
        ax.set_xticks(range(len(models)), labels, fontsize=6)
        ax.set_xlim(-0.6, len(models) - 0.4)
        ax.axhline(0, color="black", lw=0.6)
        ax.axhline(1, color="black", lw=0.4, ls=":")
        paper = paper_value("locality.field_only_zero")
        ax.axhline(paper.single, color="black", lw=0.8, ls="--",
                   label=f"paper, rule after the field: {paper.shown()} (Llama-3.1-8B)" if ax is axes[0][0] else None)
        ax.set_title(title, fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
    axes[0][0].set_ylim(-0.2, 1.15)
    axes[0][0].set_ylabel("field-only recovery\n(fraction of the oracle flip)", fontsize=7)
    fig.suptitle("Fig. 3a: the field's own K/V carries the decision only when the rule comes before it", fontsize=8,
                 y=0.985)
    fig.text(0.5, 0.93, "included instances (oracle flip >= 0.5 nats; included / run over each bar), 95% cluster CI; "
             "stale 0, full-downstream and oracle 1 by construction (not drawn)", ha="center", va="bottom",
             fontsize=5.5, color="#444444")
    handles, names = [], []
    for ax in axes[0]:
        h, n = ax.get_legend_handles_labels()
        handles, names = handles + h, names + n
    order = sorted(range(len(names)), key=lambda i: names[i].startswith("paper"))
    fig.legend([handles[i] for i in order], [names[i] for i in order], fontsize=6, ncol=3, loc="lower center",
               frameon=False)
    fig.subplots_adjust(left=0.11, right=0.99, top=0.83, bottom=0.25, wspace=0.06)
    fig._kvprobe_laid_out = True
    save(fig, path)


def figC_offtemplate(records: list[dict[str, Any]], path: Path) -> None:
    """Appendix C off-template generalization: field-only vs full-downstream recovery on every published prompt
    shape, one panel per model that has more than one (gated instances; hatched: none included, all instances)."""
    by_model: dict[str, list[dict[str, Any]]] = {}
    for rec in tagged(records):
        by_model.setdefault(rec["model"]["name"], []).append(rec)
    by_model = {n: recs for n, recs in by_model.items() if len(recs) > 1}
    if not by_model:
        return
    cols = min(2, len(by_model))
    rows = (len(by_model) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.5, 2.9 * rows), squeeze=False)
    width = 0.38
    for ax, (name, recs) in zip(axes.flat, by_model.items()):
        labels = []
        for i, rec in enumerate(recs):
            summary = rec["summary"]
            which = "gated" if summary["n_included"] > 0 else "all"
            for s, state in enumerate(("field_only", "full_downstream")):
                stat = dict(summary["recovery"][state][which])
                if stat.get("mean") is not None and not YLIM[0] <= stat["mean"] <= YLIM[1]:
                    ax.annotate(f"{stat['mean']:+.1f}", (i + (s - 0.5) * width, YLIM[1]), ha="center", va="top",
                                fontsize=6)
                    stat = {"mean": YLIM[1]}
                bar_with_ci(ax, i + (s - 0.5) * width, stat, width, COLORS[state],
                            label=state.replace("_", "-") if i == 0 else None)
                if which == "all":
                    ax.patches[-1].set_hatch("///")
                    ax.patches[-1].set_alpha(0.5)
            shape = task_label(rec).replace(": ", ":\n").replace("+", "+\n")
            labels.append(f"{shape}\n{summary['n_included']}/{summary['n_instances']} incl.")
        ax.set_xticks(range(len(recs)), labels, fontsize=6)
        ax.set_ylim(*YLIM)
        ax.axhline(0, color="black", lw=0.6)
        ax.axhline(1, color="black", lw=0.4, ls=":")
        ax.set_title(name, fontsize=8)
        ax.set_ylabel("recovery", fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
    for ax in list(axes.flat)[len(by_model):]:
        ax.axis("off")
    fig.suptitle("Off-template and generated prompt shapes (paper App. C: field-only ~0 off-template, "
                 "0.25-0.63 on attribute)", fontsize=8)
    legend_below(fig, axes[0][0])
    save(fig, path)


# figure file stem -> (experiment whose records it reads, drawing function), collected by kvprobe.figures
FIGURES = {
    "fig3a_locality": ("", fig3a_locality),  # reads locality and locality_distance (the rule-position runs)
    "figC_offtemplate": ("locality", figC_offtemplate),
}
