"""Figure 6b: transplanted skill vs full recompute: next-token logit cosine and decision agreement per model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import bar_with_ci, latest_per_model, legend_below, save, short_model
from kvprobe.paper import paper_value


def fig6b_transplant(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records)
    names = list(per_model)
    variants: list[str] = []  # the union over models, in record order (older records have fewer variants)
    for rec in per_model.values():
        variants += [v for v in rec["summary"]["variants"] if v not in variants]
    lows = [st["mean"] if st.get("ci_low") is None else st["ci_low"] for rec in per_model.values()
            for st in (v.get("cosine", {}) for v in rec["summary"]["variants"].values())
            if st.get("mean") is not None]
    fig, axes = plt.subplots(1, 2, figsize=(6.5, 3.4))
    width = 0.8 / len(variants)
    cmap = plt.get_cmap("tab20")
    for ax, metric, label in ((axes[0], "cosine", "logit cosine vs full recompute"),
                              (axes[1], "agreement", "decision agreement")):
        for m, name in enumerate(names):
            for v, variant in enumerate(variants):
                stat = per_model[name]["summary"]["variants"].get(variant, {}).get(metric, {})
                bar_with_ci(ax, m + (v - (len(variants) - 1) / 2) * width, stat, width, cmap(v),
                            label=variant if m == 0 else None)
        ax.set_xticks(range(len(names)), [short_model(n).replace(" org.", "\norg.") for n in names], fontsize=6)
        ax.set_ylabel(label, fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
    # low enough that a collapsed control (cosine ~0.8) is visible, not clipped
    # and low enough that the paper's cosine band is a band on the axis, not the whole axis
    axes[0].set_ylim(min(0.8, (min(lows) if lows else 0.8) - 0.02), 1.0005)
    axes[1].set_ylim(0, 1.12)
    cosine, agreement = paper_value("transplant.skill_cosine"), paper_value("transplant.skill_agreement")
    axes[0].axhspan(*cosine.low_high, color="grey", alpha=0.15, lw=0)
    axes[0].annotate(f"paper {cosine.shown()}", (1.0, cosine.low_high[1]), xycoords=("axes fraction", "data"),
                     ha="right", va="bottom", fontsize=6)
    axes[1].axhline(agreement.single, color="black", lw=0.9, ls="--")
    axes[1].annotate(f"paper {agreement.shown()} (models that decide rightly)",
                     (1.0, agreement.single), xycoords=("axes fraction", "data"), ha="right", va="bottom", fontsize=6)
    fig.suptitle("Transplanted skill vs full recompute (paper Fig. 6b)", fontsize=10)
    legend_below(fig, axes[1], ncol=4)
    save(fig, path)


FIGURES = {"fig6b_transplant": ("transplant", fig6b_transplant)}
