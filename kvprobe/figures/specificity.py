"""Table 4 (right) as a figure: top-k vs random-k downstream positions patched into the stale cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import latest_per_model, legend_below, paper_band, save
from kvprobe.figures.mechanism import grouped_bars
from kvprobe.paper import paper_value
from kvprobe.probes.summary import which


def table4_specificity(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records)
    ks = next(iter(per_model.values()))["summary"]["ks"]
    keys = [f"{kind}{k}" for k in ks for kind in ("top", "rand")]
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    grouped_bars(ax, per_model, keys, ["#3a78b5", "#bdbdbd", "#1f4e79", "#8d8d8d"],
                 lambda s, k: s["recovery"][k][which(s)])
    ax.set_ylabel("decision recovery", fontsize=8)
    ax.set_title("Specificity: top-k vs random-k (paper Table 4 right)", fontsize=10)
    top8, rand8 = paper_value("figure.table4_specificity.top8"), paper_value("figure.table4_specificity.random8")
    paper_band(ax, *top8.low_high, f"paper top-8 {top8.shown()}", color="#3a78b5")
    paper_band(ax, *rand8.low_high, f"paper rand-8 <= {rand8.low_high[1]:g}", color="#8d8d8d")
    legend_below(fig, ax, ncol=len(keys))
    save(fig, path)


FIGURES = {"table4_specificity": ("specificity", table4_specificity)}
