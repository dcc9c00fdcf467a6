"""Figure 3a: decision recovery of the four cache states, per model, with bootstrap CIs.

Bars use the gated instances. A model with no gated instance is drawn hatched from all instances and
labelled so, because a recovery over near-zero oracle flips is a ratio of noise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import bar_with_ci, legend_below, main_per_model, save, short_model, tagged, task_label

STATES = ("stale", "field_only", "full_downstream", "oracle")
COLORS = {"stale": "#9e9e9e", "field_only": "#e07b39", "full_downstream": "#3a78b5", "oracle": "#2e7d32"}
YLIM = (-0.5, 1.5)


def fig3a_locality(records: list[dict[str, Any]], path: Path) -> None:
    """One bar group per model, on its main prompt shape (named under the model: the template, or the chat
    layout where a pretrained model gates only there)."""
    per_model = main_per_model(records)
    if not per_model:
        return
    names = list(per_model)
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    width = 0.2
    for m, name in enumerate(names):
        summary = per_model[name]["summary"]
        which = "gated" if summary["n_included"] > 0 else "all"
        for s, state in enumerate(STATES):
            stat = dict(summary["recovery"][state][which])
            x = m + (s - 1.5) * width
            if stat.get("mean") is not None and not YLIM[0] <= stat["mean"] <= YLIM[1]:
                ax.annotate(f"{stat['mean']:+.1f}", (x, YLIM[1] if stat["mean"] > 0 else YLIM[0]), ha="center",
                            va="bottom" if stat["mean"] > 0 else "top", fontsize=6, annotation_clip=False)
            bar_with_ci(ax, x, stat, width, COLORS[state], label=state.replace("_", "-") if m == 0 else None)
            if which == "all":
                ax.patches[-1].set_hatch("///")
                ax.patches[-1].set_alpha(0.5)
    labels = []
    for n in names:
        s = per_model[n]["summary"]
        tag = f"{s['n_included']}/{s['n_instances']} incl." if s["n_included"] else f"0/{s['n_instances']} incl. (hatched)"
        labels.append(f"{short_model(n)}\n{task_label(per_model[n])}\n{tag}\n"
                      f"flip median {s['oracle_flip'].get('median', float('nan')):.2f} nats")
    ax.set_xticks(range(len(names)), labels, fontsize=7)
    ax.set_ylim(*YLIM)
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.axhline(0, color="black", lw=0.6)
    ax.axhline(1, color="black", lw=0.4, ls=":")
    ax.axhline(-0.028, color="#e07b39", lw=0.8, ls="--")
    ax.annotate("paper field-only -0.028 (Llama-3.1-8B)", (len(names) - 0.45, -0.028), ha="right", va="top",
                fontsize=6, color="#e07b39")
    ax.set_ylabel("decision recovery (fraction of oracle flip)", fontsize=8)
    ax.set_title("Locality (paper Fig. 3a)", fontsize=10)
    legend_below(fig, ax, ncol=4)
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
