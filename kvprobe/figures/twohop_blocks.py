"""Appendix G / Figure 24 (right): agreement with full recompute when a two-hop pair is split across two
independently precompiled blocks, kept together, or the memory is one block; the independent-pair control
beside it; the full-recompute accuracy above each model (the comparison needs it above chance)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import bar_with_ci, latest_per_model, save, short_model

LAYOUTS = ("split", "together", "one_block")


def figG_twohop_blocks(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records)
    if not per_model:
        return
    fig, axes = plt.subplots(1, 2, figsize=(6.5, 3.6), sharey=True)
    cmap = plt.get_cmap("tab10")
    width = 0.25
    for ax, cond in zip(axes, ("twohop", "independent")):
        for m, (model, rec) in enumerate(per_model.items()):
            s = rec["summary"][cond]
            for j, lay in enumerate(LAYOUTS):
                bar_with_ci(ax, m + (j - 1) * width, s[f"{lay}_agreement"], width, cmap(j),
                            label=lay if m == 0 else None)
            acc = s["full_accuracy"]["mean"]
            note = "" if cond == "independent" or rec["summary"]["informative"] else "\n(uninformative)"
            ax.text(m, 1.07, f"full acc {acc:.2f}{note}", ha="center", fontsize=6)
            if note:  # the full recompute is at chance: the layouts' agreement cannot show the paper's effect
                ax.axvspan(m - 0.45, m + 0.45, color="#dddddd", zorder=0, lw=0)
        ax.set_xticks(range(len(per_model)), [short_model(n).replace(" org. ", "\norg. ") for n in per_model],
                      fontsize=6)
        ax.tick_params(axis="y", labelsize=6)
        ax.set_title("two-hop pair (A -> B)" if cond == "twohop" else "control: independent pair", fontsize=9)
        ax.set_ylim(0, 1.2)
    axes[0].set_ylabel("decision agreement with full recompute", fontsize=7)
    axes[1].legend(fontsize=6, loc="lower right")
    fig.suptitle("Two-hop facts across precompiled blocks (paper App. G; grey: uninformative, at chance)", fontsize=8)
    save(fig, path)


FIGURES = {"figG_twohop_blocks": ("twohop_blocks", figG_twohop_blocks)}
