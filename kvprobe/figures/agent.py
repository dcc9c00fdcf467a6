"""Figures 7b / 12: the unified edit+compose agent beside the placement baselines. Left: decision agreement
with full recompute (exact CI) per path and model; right: tokens each path prefilled over the unified path's
(reprefill every turn, front and end placement with a prefix cache; wall-clock TTFT: benchmarks/agent.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import bar_with_ci, latest_per_model, save, short_model


def fig7b_agent(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records)
    if not per_model:
        return
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(6.5, 3.4))
    colors = {"unified": "tab:blue", "front": "tab:orange", "end": "tab:green", "reprefill": "tab:grey"}
    for m, (model, rec) in enumerate(per_model.items()):
        s = rec["summary"]
        base = s.get("baselines", {})
        paths = [("unified", s["agreement"], 1.0)] + [(b, base[b]["agreement_last_turn"], base[b]["prefill_ratio_mean"])
                                                      for b in ("front", "end") if b in base]
        w = 0.8 / len(paths)
        for j, (name, agree, _) in enumerate(paths):
            bar_with_ci(ax, m + (j - (len(paths) - 1) / 2) * w, agree, w, colors[name],
                        label=name if m == 0 else None)
        ratios = [("reprefill", s["prefill_ratio_mean"])] + [(b, base[b]["prefill_ratio_mean"])
                                                             for b in ("front", "end") if b in base]
        w = 0.8 / len(ratios)
        for j, (name, r) in enumerate(ratios):
            ax2.bar(m + (j - (len(ratios) - 1) / 2) * w, r, w, color=colors[name], label=name if m == 0 else None)
    labels = [short_model(m).replace(" org. ", "\norg. ") for m in per_model]
    for a in (ax, ax2):
        a.set_xticks(range(len(per_model)), labels, fontsize=6)
        a.tick_params(axis="y", labelsize=6)
        a.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("decision agreement with full recompute", fontsize=7)
    ax.set_title("agreement\n(front/end: last turn, own recompute)", fontsize=7)
    ax2.axhline(1.0, color="tab:blue", lw=0.8, ls="--")
    ax2.set_ylabel("prefilled tokens over the unified path's", fontsize=7)
    ax2.set_title("cumulative prefill\n(dashed: unified = 1)", fontsize=7)
    fig.suptitle("Unified edit+compose agent vs placement baselines (paper Fig. 7b, 12)", fontsize=8)
    fig.subplots_adjust(bottom=0.27, top=0.82, left=0.09, right=0.98, wspace=0.3)
    fig._kvprobe_laid_out = True
    save(fig, path)


FIGURES = {"fig7b_agent": ("agent", fig7b_agent)}
