"""Figure 7b: the unified edit+compose agent; agreement with full recompute per model (exact CI) and the
prefilled-token ratio of reprefill-every-turn over the unified path (wall-clock TTFT: benchmarks/agent.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import bar_with_ci, latest_per_model, save


def fig7b_agent(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records)
    if not per_model:
        return
    fig, ax = plt.subplots(figsize=(3 + 1.6 * len(per_model), 3.6))
    ax2 = ax.twinx()
    for m, (model, rec) in enumerate(per_model.items()):
        s = rec["summary"]
        bar_with_ci(ax, m, s["agreement"], 0.6, "tab:blue", label="agreement" if m == 0 else None)
        ax2.plot(m, s["prefill_ratio_mean"], "D", color="tab:red", label="prefilled-token ratio" if m == 0 else None)
    ax.set_xticks(range(len(per_model)), list(per_model), fontsize=7)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("unified vs full-recompute agreement")
    ax2.set_ylabel("reprefill / unified prefilled tokens")
    ax2.set_ylim(bottom=0)
    fig.legend(fontsize=7, loc="lower left")
    fig.suptitle("Unified edit+compose agent (paper Fig. 7b)", fontsize=10)
    save(fig, path)


FIGURES = {"fig7b_agent": ("agent", fig7b_agent)}
