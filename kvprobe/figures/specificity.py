"""Table 4 (right) as a figure: top-k vs random-k downstream positions patched into the stale cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import latest_per_model, save
from kvprobe.figures.mechanism import grouped_bars
from kvprobe.probes.summary import which


def table4_specificity(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records)
    ks = next(iter(per_model.values()))["summary"]["ks"]
    keys = [f"{kind}{k}" for k in ks for kind in ("top", "rand")]
    fig, ax = plt.subplots(figsize=(3.0 + 2.0 * len(per_model), 3.6))
    grouped_bars(ax, per_model, keys, ["#3a78b5", "#bdbdbd", "#1f4e79", "#8d8d8d"],
                 lambda s, k: s["recovery"][k][which(s)])
    ax.set_ylabel("decision recovery")
    ax.set_title("Specificity: top-k vs random-k (paper Table 4 right)", fontsize=10)
    ax.legend(fontsize=7, ncol=len(keys))
    save(fig, path)
