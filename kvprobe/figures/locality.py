"""Figure 3a: decision recovery of the four cache states, per model, with bootstrap CIs over gated instances."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import bar_with_ci, latest_per_model, save

STATES = ("stale", "field_only", "full_downstream", "oracle")
COLORS = {"stale": "#9e9e9e", "field_only": "#e07b39", "full_downstream": "#3a78b5", "oracle": "#2e7d32"}


def fig3a_locality(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records)
    fig, ax = plt.subplots(figsize=(1.9 + 1.7 * len(per_model), 3.4))
    width = 0.2
    names = list(per_model)
    for m, name in enumerate(names):
        summary = per_model[name]["summary"]
        for s, state in enumerate(STATES):
            bar_with_ci(ax, m + (s - 1.5) * width, summary["recovery"][state]["gated"], width, COLORS[state],
                        label=state.replace("_", "-") if m == 0 else None)
    labels = [f"{n}\n{per_model[n]['summary']['n_included']}/{per_model[n]['summary']['n_instances']} gated"
              for n in names]
    ax.set_xticks(range(len(names)), labels, fontsize=8)
    ax.axhline(0, color="black", lw=0.6)
    ax.axhline(1, color="black", lw=0.4, ls=":")
    ax.set_ylabel("decision recovery")
    ax.set_title("Locality: refreshing the field's own KV (Fig. 3a)", fontsize=10)
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    save(fig, path)
