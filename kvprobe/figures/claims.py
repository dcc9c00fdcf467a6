"""The claims figure (kvprobe.claims; paper Appendix H's confirmatory protocol), page-sized: per model, how
many of the paper's effects reached each verdict (left), and, apart, the controls, sanity checks and
identities (right). Bars are counts of claim x task rows; the left panel's label is the headline, "k of N paper
effects reproduced" (effects with a paper number only). The per-row numbers (ours with its interval, the
paper's value, the bounds, power) are in the claims table and ``results/claims.json``. Reads records only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import save

COLORS = {"reproduced": "tab:green", "outside the paper's range": "tab:purple", "inconclusive": "tab:olive",
          "not reproduced": "tab:red", "not measurable": "tab:orange", "identity": "tab:gray",
          "no paper number": "lightgray"}


def _counts(rows: list[dict[str, Any]], models: list[str]) -> dict[str, list[int]]:
    out = {v: [0] * len(models) for v in COLORS}
    for r in rows:
        head = r["verdict"].split(" (")[0]
        out.setdefault(head, [0] * len(models))[models.index(r["model"])] += 1
    return out


def fig_claims(records: list[dict[str, Any]], path: Path) -> None:
    from kvprobe.claims import claims_rows, headline

    rows = claims_rows(records)
    if not rows:
        return
    models = sorted({r["model"] for r in rows})
    heads = headline(rows)
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.42 * len(models) + 1.8), sharey=True)
    for ax, role, title in ((axes[0], "effect", "the paper's effects"),
                            (axes[1], "control", "controls, sanity checks, identities")):
        part = [r for r in rows if (r.get("role") or "control") == role]
        left = [0] * len(models)
        for verdict, counts in _counts(part, models).items():
            if not any(counts):
                continue
            ax.barh(range(len(models)), counts, left=left, color=COLORS.get(verdict, "black"), label=verdict)
            left = [a + b for a, b in zip(left, counts)]
        if role == "control":  # room for the legend on the right
            ax.set_xlim(0, max(max(left), 1) * 1.5)
        ax.set_title(f"{title} (BH within this family)", fontsize=9)
        ax.set_xlabel("claim x task rows", fontsize=8)
        ax.tick_params(labelsize=7)
        if role == "effect":
            for y, m in enumerate(models):
                h = heads.get(m)
                if h:
                    ax.text(left[y] + 0.3, y, f"{h['reproduced']} of {h['effects']}", va="center", fontsize=7)
    axes[0].set_yticks(range(len(models)), models, fontsize=7)
    axes[0].invert_yaxis()
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    axes[1].legend(handles, labels, fontsize=7, loc="lower right")
    fig.suptitle("Paper claims per model: k of N paper effects reproduced (left), controls apart (right)",
                 fontsize=10)
    save(fig, path, dpi=110)
