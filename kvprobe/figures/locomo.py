"""Figure 11: LoCoMo, precompiled + spliced sessions vs full recompute per question category: token F1 of
both (left); agreement with full recompute (middle: greedy answers identical, first answer token identical,
and the no-rotation control's first token); 1 - the first answer token's logit cosine, re-rotated vs the
no-rotation control (right, log scale), per model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import bar_with_ci, latest_per_model, save, short_model

ARMS = (("full", "full recompute", "#4c72b0"), ("spliced", "spliced sessions", "#dd8452"))
AGREE = (("answer_agreement", "greedy answers identical", "#55a868"),
         ("first_token_agreement", "first answer token", "#8172b2"),
         ("no_rotation_first_token_agreement", "first token, no rotation (control)", "#c44e52"))
GAP = (("cosine", "re-rotated", "#8172b2"), ("no_rotation_cosine", "no rotation (control)", "#c44e52"))


def fig11_locomo(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records)
    if not per_model:
        return
    n = len(per_model)
    # one column per model, the three measures stacked: a 6.5-inch column
    fig, axes = plt.subplots(3, n, figsize=(6.5, 8.0), squeeze=False)
    for row, (model, rec) in zip(axes.T, per_model.items()):
        s = rec["summary"]
        groups = {**s["by_category"], "all": s}
        names = list(groups)
        ax = row[0]
        for j, (arm, label, color) in enumerate(ARMS):
            for i, g in enumerate(names):
                bar_with_ci(ax, i + (j - 0.5) * 0.38, groups[g]["f1"][arm], 0.38, color, label if i == 0 else None)
        ax.set_xticks(range(len(names)), [f"{g.replace('_', chr(10))}\nn={groups[g]['n']}" for g in names], fontsize=6)
        ax.set_ylabel("token F1 vs gold", fontsize=7)
        ax.set_ylim(0, max(0.3, 1.25 * max(groups[g]["f1"][a]["ci_high"] or groups[g]["f1"][a]["mean"] or 0
                                            for g in names for a, _, _ in ARMS)))
        d = s["f1_difference"]
        ax.set_title(f"{short_model(model)}\nQA: spliced - full {d['mean']:+.3f} (TOST margin 0.03)", fontsize=7)
        ax.legend(fontsize=6, loc="upper left", frameon=False)
        ax = row[1]
        for j, (key, label, color) in enumerate(AGREE):
            for i, g in enumerate(names):
                bar_with_ci(ax, i + (j - 1) * 0.27, groups[g][key], 0.27, color, label if i == 0 else None)
        ax.set_xticks(range(len(names)), [g.replace("_", "\n") for g in names], fontsize=6)
        ax.set_ylim(0, 1.55)
        ax.set_yticks([0, 0.25, 0.5, 0.75, 1.0])
        ax.set_ylabel("agreement with full recompute", fontsize=7)
        ax.set_title("greedy answers and first answer token", fontsize=7)
        ax.legend(fontsize=5, loc="upper center", frameon=False, ncol=2)
        ax = row[2]  # 1 - cosine on a log axis: both arms sit near 1, the control's gap is the contrast
        for j, (key, label, color) in enumerate(GAP):
            for i, g in enumerate(names):
                m = groups[g][key]["mean"]
                if m is not None:
                    ax.bar(i + (j - 0.5) * 0.38, max(1 - m, 1e-7), 0.38, color=color, label=label if i == 0 else None)
        ax.set_yscale("log")
        ax.axhline(0.02, color="grey", lw=0.6, ls=":")
        ax.set_ylim(top=0.3)
        ax.set_xticks(range(len(names)), [g.replace("_", "\n") for g in names], fontsize=6)
        ax.set_ylabel("1 - logit cosine (log)", fontsize=7)
        ax.set_title("distance from full recompute\n(dotted: App. H cosine 0.98)", fontsize=7)
        ax.legend(fontsize=5, loc="upper left", frameon=False)
        for ax in row:
            ax.tick_params(labelsize=6)
    fig.suptitle("LoCoMo: precompiled, re-rotated sessions vs full recompute (paper Fig. 11)", fontsize=9)
    save(fig, path)


FIGURES = {"fig11_locomo": ("locomo", fig11_locomo)}
