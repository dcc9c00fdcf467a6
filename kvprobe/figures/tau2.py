"""Section 9 on τ²-bench retail: P(correct terminal action) per arm and mode (the environment's tool scores
it) and the transplanted policy's agreement with full recompute."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import bar_with_ci, latest_per_model, save, short_model


def sec9_tau2(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records)
    if not per_model:
        return
    names = list(per_model)
    cells = [("arm_a", m) for m in ("full", "transplant")] + \
            [("arm_b", m) for m in ("stale", "in_place", "erratum", "field_erratum", "transplant", "full_reprefill")]
    # the two measures stacked: a 6.5-inch column whatever the number of models
    fig, axes = plt.subplots(2, 1, figsize=(6.5, 5.6), gridspec_kw={"height_ratios": [3, 2]})
    width = 0.8 / len(cells)
    cmap = plt.get_cmap("tab10")
    for m, name in enumerate(names):
        s = per_model[name]["summary"]
        for j, (arm, mode) in enumerate(cells):
            bar_with_ci(axes[0], m + (j - (len(cells) - 1) / 2) * width, s[arm][mode]["p_correct"], width,
                        cmap(j), label=f"{arm[-1].upper()}: {mode}" if m == 0 else None)
        t = s["transplant_vs_full"]
        for j, key in enumerate(("agreement_a", "agreement_b")):
            bar_with_ci(axes[1], m + (j - 0.5) * 0.35, t[key], 0.35, cmap(j), label=key if m == 0 else None)
    for ax, title in ((axes[0], "P(correct terminal action), scored by cancel_pending_order"),
                      (axes[1], "transplanted policy: agreement with full")):
        ax.set_xticks(range(len(names)), [short_model(n) for n in names], fontsize=6)
        ax.set_ylim(0, 1.05)
        ax.set_title(title, fontsize=8)
        ax.tick_params(axis="y", labelsize=6)
        ax.legend(fontsize=5.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    axes[0].axhline(0.5, color="grey", lw=0.6, ls=":")
    fig.suptitle("τ²-bench retail: state change mid-trajectory (paper Sec. 9)", fontsize=9)
    save(fig, path)


FIGURES = {"sec9_tau2": ("tau2", sec9_tau2)}  # Sec. 9: τ²-bench retail
