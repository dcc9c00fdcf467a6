"""Figure 3a: decision recovery of the four cache states, per model, with bootstrap CIs.

Bars use the gated instances. A model with no gated instance is drawn hatched from all instances and
labelled so, because a recovery over near-zero oracle flips is a ratio of noise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import GATED_TEMPLATE, bar_with_ci, latest_per_model, save, task_template

STATES = ("stale", "field_only", "full_downstream", "oracle")
COLORS = {"stale": "#9e9e9e", "field_only": "#e07b39", "full_downstream": "#3a78b5", "oracle": "#2e7d32"}
YLIM = (-0.5, 1.5)


def fig3a_locality(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records, GATED_TEMPLATE)
    if not per_model:
        return
    names = list(per_model)
    fig, ax = plt.subplots(figsize=(3.0 + 1.8 * len(names), 3.6))
    width = 0.2
    for m, name in enumerate(names):
        summary = per_model[name]["summary"]
        which = "gated" if summary["n_included"] > 0 else "all"
        for s, state in enumerate(STATES):
            stat = dict(summary["recovery"][state][which])
            x = m + (s - 1.5) * width
            if stat.get("mean") is not None and not YLIM[0] <= stat["mean"] <= YLIM[1]:
                ax.annotate(f"{stat['mean']:+.1f}", (x, YLIM[1] if stat["mean"] > 0 else YLIM[0]), ha="center",
                            va="top" if stat["mean"] > 0 else "bottom", fontsize=6)
            bar_with_ci(ax, x, stat, width, COLORS[state], label=state.replace("_", "-") if m == 0 else None)
            if which == "all":
                ax.patches[-1].set_hatch("///")
                ax.patches[-1].set_alpha(0.5)
    labels = []
    for n in names:
        s = per_model[n]["summary"]
        tag = f"{s['n_included']}/{s['n_instances']} gated" if s["n_included"] else f"0/{s['n_instances']} gated (hatched: all)"
        labels.append(f"{n}\n{tag}\nflip median {s['oracle_flip'].get('median', float('nan')):.2f}")
    ax.set_xticks(range(len(names)), labels, fontsize=7)
    ax.set_ylim(*YLIM)
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.axhline(0, color="black", lw=0.6)
    ax.axhline(1, color="black", lw=0.4, ls=":")
    ax.set_ylabel("decision recovery")
    ax.set_title("Locality (paper Fig. 3a)", fontsize=10)
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.32), frameon=False)
    save(fig, path)


def figC_offtemplate(records: list[dict[str, Any]], path: Path) -> None:
    """Appendix C off-template generalization: field-only vs full-downstream recovery per task template.

    One panel per model that has an off-template locality record; bars per template (newest record of
    each), gated instances where any pass the gate, else all instances (hatched), as in Figure 3a.
    """
    templates = sorted({task_template(r) for r in records}, key=lambda t: (t != GATED_TEMPLATE, t))
    by_model: dict[str, dict[str, dict[str, Any]]] = {}
    for t in templates:
        for name, rec in latest_per_model(records, t).items():
            by_model.setdefault(name, {})[t] = rec
    by_model = {n: recs for n, recs in by_model.items() if any(t != GATED_TEMPLATE for t in recs)}
    if not by_model:
        return
    fig, axes = plt.subplots(1, len(by_model), figsize=(4.2 * len(by_model), 3.6), squeeze=False)
    width = 0.38
    for ax, (name, recs) in zip(axes[0], by_model.items()):
        labels = []
        for i, (t, rec) in enumerate(recs.items()):
            summary = rec["summary"]
            which = "gated" if summary["n_included"] > 0 else "all"
            for s, state in enumerate(("field_only", "full_downstream")):
                bar_with_ci(ax, i + (s - 0.5) * width, dict(summary["recovery"][state][which]), width,
                            COLORS[state], label=state.replace("_", "-") if i == 0 else None)
                if which == "all":
                    ax.patches[-1].set_hatch("///")
                    ax.patches[-1].set_alpha(0.5)
            short = Path(t).stem
            labels.append(f"{short}\n{summary['n_included']}/{summary['n_instances']} gated\n"
                          f"flip {summary['oracle_flip'].get('median', float('nan')):.2f}")
        ax.set_xticks(range(len(recs)), labels, fontsize=7)
        ax.set_ylim(*YLIM)
        ax.axhline(0, color="black", lw=0.6)
        ax.axhline(1, color="black", lw=0.4, ls=":")
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("decision recovery")
    axes[0][0].legend(fontsize=7, loc="upper left", frameon=False)
    fig.suptitle("Off-template generalization (paper Appendix C)", fontsize=10)
    save(fig, path)
